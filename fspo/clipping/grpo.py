"""GRPO's token-level clip (DAPO clip-higher + dual clip): verl's `compute_policy_loss_vanilla`.

Owns: `GRPOClip`. Leaves out: aggregation (fspo/losses.py), advantages (fspo/advantages.py).
"""
from __future__ import annotations

from typing import Optional

from torch import Tensor

from fspo.clipping._common import (
    MAX_LOG_RATIO,
    RatioClipRule,
    cap_mask,
    prepare,
    ratio_clip,
    token_advantage,
    token_log_ratio,
)
from fspo.clipping.base import ClipResult
from fspo.clipping.settings import RatioClipSettings as GRPO


class GRPOClip(RatioClipRule):
    """Token-level PPO clip in ratio space, exactly verl's vanilla policy loss.

    Per token: d_t = clamp(logp_new - logp_old, -20, 20), r_t = exp(d_t),
    loss_t = max(-A r_t, -A clip(r_t, 1 - low, 1 + high)), and for A < 0
    loss_t = min(loss_t, -A * clip_ratio_c) (dual clip). Paper settings (Table 5): low 0.2,
    high 0.28, dual 3.0. ``token_loss`` is 0 on padding; masks follow verl's strict comparisons.
    ``in_band`` (per token): 1 - low <= r_t <= 1 + high; ``clip_cap``: |d_t| > 20, no clip binding.
    """

    level = "token"

    def __init__(self, clip_ratio_low: float = GRPO.clip_ratio_low, clip_ratio_high: float = GRPO.clip_ratio_high,
                 clip_ratio_c: Optional[float] = GRPO.clip_ratio_c) -> None:
        super().__init__(clip_ratio_low, clip_ratio_high, clip_ratio_c)

    def forward(self, log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor,
                response_mask: Tensor) -> ClipResult:
        p = prepare(type(self).__name__, log_prob, old_log_prob, advantages, response_mask)
        d = token_log_ratio(p)
        adv = token_advantage(advantages, p)
        loss, up, lo, du, ok = ratio_clip(d, adv, self.clip_ratio_low, self.clip_ratio_high, self.clip_ratio_c)
        cap = cap_mask(d, adv, up | lo | du, -MAX_LOG_RATIO, MAX_LOG_RATIO)
        m = p.mask
        return ClipResult(token_loss=loss * p.maskf, seq_log_ratio=d.detach().sum(-1),
                          clip_upper=up & m, clip_lower=lo & m, clip_dual=du & m, in_band=ok & m,
                          clip_cap=cap & m)
