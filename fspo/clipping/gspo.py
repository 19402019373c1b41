"""GSPO's length-normalised sequence clip in verl's token-level form. Under seq-mean-token-mean (GSPO's and
verl's default) every token of sequence i gets -A_i s_i / (B L_i): the gradient of paper eq. (10).
"""
from __future__ import annotations

from torch import Tensor

from fspo.clipping._common import (
    RatioClipRule,
    cap_mask,
    prepare,
    ratio_clip,
    seq_log_ratio_per_token,
    seq_result,
    token_advantage,
    token_log_ratio,
)
from fspo.clipping.base import ClipResult
from fspo.clipping.settings import GSPOSettings

#: verl clamps GSPO's log ratio from above only, at 10.
GSPO_MAX_LOG_RATIO = 10.0


class GSPOClip(RatioClipRule):
    """GSPO (paper eq. (10)), verl's `compute_policy_loss_gspo`: log s_{i,t} = sg(S_i / L_i) + logp_t - sg(logp_t)
    clamped at 10, loss = max(-A s, -A clip(s, 1 - low, 1 + high)), no dual clip. Paper: 3e-4 / 4e-4.
    ``in_band``: 1 - low <= s_i <= 1 + high; ``clip_cap``: log s_i > 10, no clip binding."""

    level = "sequence"

    def __init__(self, clip_ratio_low: float = GSPOSettings.clip_ratio_low,
                 clip_ratio_high: float = GSPOSettings.clip_ratio_high) -> None:
        super().__init__(clip_ratio_low, clip_ratio_high, None)

    def forward(self, log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor,
                response_mask: Tensor) -> ClipResult:
        p = prepare(type(self).__name__, log_prob, old_log_prob, advantages, response_mask)
        s = token_log_ratio(p).sum(-1)
        s_norm = (s / p.lengths.clamp(min=1.0)).detach()
        log_ratio = seq_log_ratio_per_token(p, s_norm, "per_token", s_norm)
        adv = token_advantage(advantages, p)
        loss, up, lo, du, ok = ratio_clip(log_ratio, adv, self.clip_ratio_low, self.clip_ratio_high, None,
                                          clamp=(None, GSPO_MAX_LOG_RATIO))
        cap = cap_mask(log_ratio, adv, up | lo | du, None, GSPO_MAX_LOG_RATIO)
        return seq_result(loss, s, up, lo, du, ok, cap, p)

    def theory_clip_fraction(self, lengths, sigma: float):
        """c(L) = P(S/L > log(1 + high)) + P(S/L < log(1 - low)), S ~ N(0, sigma^2 L) (eq. (2))."""
        from fspo.clipping.theory import c_gspo
        return c_gspo(lengths, sigma, self.clip_ratio_high, self.clip_ratio_low)
