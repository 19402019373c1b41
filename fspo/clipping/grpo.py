"""GRPO's token-level clip (DAPO clip-higher + dual clip), verl's `compute_policy_loss_vanilla`."""
from __future__ import annotations

from typing import Optional

from torch import Tensor

from fspo.clipping._common import (
    MAX_LOG_RATIO,
    RatioClipRule,
    cap_mask,
    prepare,
    ratio_clip,
    seq_result,
    token_advantage,
    token_log_ratio,
)
from fspo.clipping.base import ClipResult
from fspo.clipping.settings import RatioClipSettings as GRPO


class GRPOClip(RatioClipRule):
    """Token-level PPO clip in ratio space (paper eq. (7)), verl's vanilla: r_t = exp(clamp(d_t, -20, 20)),
    loss_t = max(-A r_t, -A clip(r_t, 1 - low, 1 + high)), for A < 0 min(loss_t, -A clip_ratio_c). Paper
    (Table 5): 0.2 / 0.28 / 3.0. ``in_band``: 1 - low <= r_t <= 1 + high; ``clip_cap``: |d_t| > 20, no clip."""

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
        return seq_result(loss, d.sum(-1), up, lo, du, ok, cap, p)
