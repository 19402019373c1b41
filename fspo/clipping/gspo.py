"""GSPO's length-normalised sequence clip, in verl's token-level form.

Owns: `GSPOClip`. Leaves out: aggregation - verl's GSPO always uses seq-mean-token-mean
(fspo/clipping/registry.py does the same); a training preset should select that mode.
"""
from __future__ import annotations

import torch
from torch import Tensor

from fspo.clipping._common import (RatioClipRule, prepare, ratio_clip, token_advantage,
                                   token_log_ratio)
from fspo.clipping.base import ClipResult

#: verl clamps GSPO's log ratio from above only, at 10.
GSPO_MAX_LOG_RATIO = 10.0


class GSPOClip(RatioClipRule):
    """GSPO (paper eq. gspo) exactly as verl's `compute_policy_loss_gspo`.

    s_i = exp(S_i / L_i) (L_i clamped to >= 1), made token-level so that the gradient flows through
    each token: log s_{i,t} = sg[S_i / L_i] + logp_t - sg[logp_t], clamped at max 10;
    loss_{i,t} = max(-A s_{i,t}, -A clip(s_{i,t}, 1 - low, 1 + high)); no dual clip.
    Paper settings: low 3e-4, high 4e-4. The value of s_{i,t} is the same for every token of a
    sequence, so the binding masks are per sequence.
    """

    level = "sequence"

    def __init__(self, clip_ratio_low: float = 3e-4, clip_ratio_high: float = 4e-4) -> None:
        super().__init__(clip_ratio_low, clip_ratio_high, None)

    def forward(self, log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor,
                response_mask: Tensor) -> ClipResult:
        p = prepare(type(self).__name__, log_prob, old_log_prob, advantages, response_mask)
        s = token_log_ratio(p).sum(-1)
        s_norm = (s / p.lengths.clamp(min=1.0)).detach()
        lp = torch.where(p.mask, p.log_prob, 0.0)  # padding may hold -inf: keep grads finite
        log_ratio = lp - lp.detach() + s_norm.unsqueeze(-1)
        loss, up, lo, du = ratio_clip(log_ratio, token_advantage(advantages, p), self.clip_ratio_low,
                                      self.clip_ratio_high, None, clamp=(None, GSPO_MAX_LOG_RATIO))
        m = p.mask
        return ClipResult(token_loss=loss * p.maskf, seq_log_ratio=s.detach(),
                          clip_upper=up & m, clip_lower=lo & m, clip_dual=du & m)

    def theory_clip_fraction(self, lengths, sigma: float):
        """c(L) = P(S/L > log(1 + high)) + P(S/L < log(1 - low)), S ~ N(0, sigma^2 L) (eq. c_gspo)."""
        from fspo.diagnostics.theory import c_gspo
        return c_gspo(lengths, sigma, self.clip_ratio_high, self.clip_ratio_low)

