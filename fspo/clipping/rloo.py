"""RLOO's sequence-level clip: the PPO clip applied to the whole-sequence ratio exp(S_i).

Owns: `RLOOClip`. Leaves out: the leave-one-out advantage (fspo/advantages.py `rloo`) and
aggregation (fspo/losses.py).
"""
from __future__ import annotations

from typing import Optional

from torch import Tensor

from fspo.clipping._common import (
    MAX_LOG_RATIO,
    RATIO_GRADS,
    RatioClipRule,
    cap_mask,
    check_choice,
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
    """Sequence-level PPO clip in ratio space (paper eq. rloo, TRL's RLOO trainer).

    S_i = sum_t m_t (logp_new - logp_old) (float32), s_i = exp(clamp(S_i, -20, 20)),
    loss_i = max(-A_i s_i, -A_i clip(s_i, 1 - low, 1 + high)); for A_i < 0 also
    loss_i = min(loss_i, -A_i * clip_ratio_c). Paper settings: low 0.4, high 0.667, dual 3.0.
    With [B, T] advantages, A_i is their masked token mean.

    ``ratio_grad="per_token"`` (default; verl's form of a sequence ratio, see base.py):
    token t of sequence i carries loss_i with log s_{i,t} = sg(S_i) + logp_t - sg(logp_t), so where
    no clip binds d token_loss[i, t] / d logp_{i,t} = -A_i s_i, and "token-mean" gives every token
    of every sequence -A_i s_i / sum L: paper eq. rloo's gradient A_i s_i / G up to the constant
    G / sum L. ``ratio_grad="length_weighted"``: loss_i with its full gradient through S_i on each
    of its L_i tokens (L_i times the paper's weight under token-mean; for comparison only).
    Acceptance (``in_band``): 1 - low <= s_i <= 1 + high. ``clip_cap``: |S_i| > 20 with no clip binding.
    """

    level = "sequence"

    def __init__(self, clip_ratio_low: float = RLOO.clip_ratio_low, clip_ratio_high: float = RLOO.clip_ratio_high,
                 clip_ratio_c: Optional[float] = RLOO.clip_ratio_c, ratio_grad: str = RLOO.ratio_grad) -> None:
        super().__init__(clip_ratio_low, clip_ratio_high, clip_ratio_c)
        self.ratio_grad = check_choice(type(self).__name__, "ratio_grad", ratio_grad, RATIO_GRADS)

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

    def extra_repr(self) -> str:
        return super().extra_repr() + f", ratio_grad={self.ratio_grad}"

    def theory_clip_fraction(self, lengths, sigma: float):
        """c(L) = P(S > log(1 + high)) + P(S < log(1 - low)), S ~ N(0, sigma^2 L) (paper eq. c_rloo)."""
        from fspo.clipping.theory import c_rloo
        return c_rloo(lengths, sigma, self.clip_ratio_high, self.clip_ratio_low)
