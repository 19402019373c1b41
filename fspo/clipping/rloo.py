"""RLOO's sequence-level clip: the PPO clip applied to the whole-sequence ratio exp(S_i).

Owns: `RLOOClip`. Leaves out: the leave-one-out advantage (fspo/advantages.py `rloo`).
"""
from __future__ import annotations

from typing import Optional

from torch import Tensor

from fspo.clipping._common import (RatioClipRule, prepare, ratio_clip, seq_advantage, seq_result,
                                   token_log_ratio)
from fspo.clipping.base import ClipResult


class RLOOClip(RatioClipRule):
    """Sequence-level PPO clip in ratio space (paper eq. rloo, TRL's RLOO trainer).

    S_i = sum_t m_t (logp_new - logp_old) (float32), s_i = exp(clamp(S_i, -20, 20)),
    loss_i = max(-A_i s_i, -A_i clip(s_i, 1 - low, 1 + high)); for A_i < 0 also
    loss_i = min(loss_i, -A_i * clip_ratio_c). Paper settings: low 0.4, high 0.667, dual 3.0.
    loss_i is broadcast over the sequence's tokens; the gradient of an unclipped sequence is
    -A_i exp(S_i) per token. With [B, T] advantages, A_i is their masked token mean.
    """

    level = "sequence"

    def __init__(self, clip_ratio_low: float = 0.4, clip_ratio_high: float = 0.667,
                 clip_ratio_c: Optional[float] = 3.0) -> None:
        super().__init__(clip_ratio_low, clip_ratio_high, clip_ratio_c)

    def forward(self, log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor,
                response_mask: Tensor) -> ClipResult:
        p = prepare(type(self).__name__, log_prob, old_log_prob, advantages, response_mask)
        s = token_log_ratio(p).sum(-1)
        loss, up, lo, du = ratio_clip(s, seq_advantage(advantages, p), self.clip_ratio_low,
                                      self.clip_ratio_high, self.clip_ratio_c)
        return seq_result(loss, s, up, lo, du, p)

    def theory_clip_fraction(self, lengths, sigma: float):
        """c(L) = P(S > log(1 + high)) + P(S < log(1 - low)), S ~ N(0, sigma^2 L) (paper eq. c_rloo)."""
        from fspo.diagnostics.theory import c_rloo
        return c_rloo(lengths, sigma, self.clip_ratio_high, self.clip_ratio_low)
