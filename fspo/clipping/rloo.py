"""RLOO's sequence-level clip: the PPO clip on the whole-sequence ratio exp(S_i)."""
from __future__ import annotations

from typing import Optional

from torch import Tensor

from fspo.clipping._common import (
    MAX_LOG_RATIO,
    RatioClipRule,
    cap_mask,
    prepare,
    ratio_clip,
    seq_advantage,
    seq_log_ratio_per_token,
    seq_result,
    token_log_ratio,
)
from fspo.clipping.base import ClipResult
from fspo.clipping.settings import RLOOSettings as RLOO


class RLOOClip(RatioClipRule):
    """Sequence-level PPO clip in ratio space (paper eq. (8), TRL's RLOO): s_i = exp(clamp(S_i, -20, 20)),
    loss_i = max(-A_i s_i, -A_i clip(s_i, 1 - low, 1 + high)), for A_i < 0 min(loss_i, -A_i clip_ratio_c), on
    every token in the gradient form ``ratio_grad`` (base.py). Paper: 0.4 / 0.667 / 3.0. [B, T] advantages: A_i
    is their masked mean. ``in_band``: 1 - low <= s_i <= 1 + high; ``clip_cap``: |S_i| > 20, no clip binding."""

    settings = RatioClipRule.settings + ("ratio_grad",)
    settings_class = RLOO
    level = "sequence"

    def __init__(self, clip_ratio_low: float = RLOO.clip_ratio_low, clip_ratio_high: float = RLOO.clip_ratio_high,
                 clip_ratio_c: Optional[float] = RLOO.clip_ratio_c, ratio_grad: str = RLOO.ratio_grad) -> None:
        super().__init__(clip_ratio_low, clip_ratio_high, clip_ratio_c, ratio_grad=ratio_grad)

    def forward(self, log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor,
                response_mask: Tensor) -> ClipResult:
        p = prepare(type(self).__name__, log_prob, old_log_prob, advantages, response_mask)
        s = token_log_ratio(p).sum(-1)
        a = seq_advantage(advantages, p)
        log_ratio = seq_log_ratio_per_token(p, s, self.ratio_grad, s)
        bounds = (self.clip_ratio_low, self.clip_ratio_high, self.clip_ratio_c)
        loss = ratio_clip(log_ratio, a.unsqueeze(-1).expand_as(log_ratio), *bounds)[0]
        # every token of a sequence holds the sequence's value: the decisions are the sequence's
        _, up, lo, du, ok = ratio_clip(s.detach(), a, *bounds)
        cap = cap_mask(s, a, up | lo | du, -MAX_LOG_RATIO, MAX_LOG_RATIO)
        return seq_result(loss, s, up, lo, du, ok, cap, p)

    def theory_clip_fraction(self, lengths, sigma: float):
        """c(L) = P(S > log(1 + high)) + P(S < log(1 - low)), S ~ N(0, sigma^2 L) (eq. (1))."""
        from fspo.clipping.theory import c_rloo
        return c_rloo(lengths, sigma, self.clip_ratio_high, self.clip_ratio_low)
