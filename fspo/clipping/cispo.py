"""CISPO (MiniMax-M1, arXiv 2506.13585): clip the token importance weight, keep every gradient."""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from fspo.clipping._common import token_ratio_inputs, weight_clip_result
from fspo.clipping.base import ClipResult, ClipRule
from fspo.clipping.registry import _masked_mean, _ratio_kwargs, rule_loss
from fspo.clipping.settings import CISPOSettings


class CISPOClip(ClipRule):
    """CISPO's clipped IS-weight policy gradient, verl 0.9.1's ``cispo``: r_t = exp(clamp(d_t, -20, 20)),
    w_t = sg(clip(r_t, 1 - low, 1 + high)),

        J = sum_t w_t A_t logp_t,    d loss_t / d logp_t = -w_t A_t   on every token.

    ``value`` (base.py): ``verl`` token_loss = -w_t A_t logp_t, ``surrogate`` -w_t A_t (1 + logp_t - sg(logp_t)).
    Masks (A_t != 0): upper r_t > 1 + high, lower r_t < 1 - low: a bounded weight, not a zero gradient.
    ``in_band``: 1 - low <= r_t <= 1 + high. No dual, no cap.
    """

    settings = ("clip_ratio_low", "clip_ratio_high", "value")
    level = "token"

    def __init__(self, clip_ratio_low: float = CISPOSettings.clip_ratio_low,
                 clip_ratio_high: float = CISPOSettings.clip_ratio_high, value: str = CISPOSettings.value) -> None:
        super().__init__()
        self._take(CISPOSettings(clip_ratio_low, clip_ratio_high, value, owner=type(self).__name__))

    def forward(self, log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor,
                response_mask: Tensor) -> ClipResult:
        p, d, adv, ratio = token_ratio_inputs(type(self).__name__, log_prob, old_log_prob, advantages,
                                              response_mask)
        clipped = torch.clamp(ratio, 1.0 - self.clip_ratio_low, 1.0 + self.clip_ratio_high)
        w = clipped.detach()
        lp = torch.where(p.mask, p.log_prob, 0.0)  # padding may hold -inf: keep grads finite
        factor = lp if self.value == "verl" else 1.0 + lp - lp.detach()
        return weight_clip_result(-w * adv * factor, d, ratio, ratio.detach() == w, adv, p)


@rule_loss("cispo", metrics=lambda res, m, *_: {"actor/pg_clipfrac": _masked_mean(~res.in_band, m)})
def policy_loss_cispo(config: Any) -> ClipRule:
    """verl's ``cispo``: `CISPOClip(value="verl")`. ``actor/pg_clipfrac`` = token share with r != clip(r),
    ``actor/pg_clipfrac_lower`` = 0."""
    return CISPOClip(**_ratio_kwargs(config, CISPOClip), value="verl")
