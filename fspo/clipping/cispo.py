"""CISPO (MiniMax-M1, arXiv 2506.13585): clip the token importance-sampling weight, keep every gradient.

Owns: `CISPOClip` and the registry name ``cispo`` (verl 0.9.1's `compute_policy_loss_cispo`,
tests/test_verl_parity.py). Leaves out: aggregation (fspo/losses.py; MiniMax-M1 and verl's
default are token-mean, conf/method/cispo.yaml).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from fspo.clipping._common import token_ratio_inputs, weight_clip_result
from fspo.clipping.base import ClipResult, ClipRule
from fspo.clipping.registry import _masked_mean, _ratio_kwargs, _run, register_policy_loss
from fspo.clipping.settings import CISPOSettings


class CISPOClip(ClipRule):
    """CISPO's clipped IS-weight policy gradient (the MiniMax-M1 objective), exactly verl 0.9.1's ``cispo``.

    Per token: d_t = clamp(logp_new - logp_old, -20, 20), r_t = exp(d_t),
    w_t = sg(clip(r_t, 1 - low, 1 + high)), and

        J = sum_t w_t A_t logp_t    so    d loss_t / d logp_t = -w_t A_t   on every token.

    Unlike the PPO clip (GRPO), no token loses its gradient: the clip only bounds its weight.
    ``value="surrogate"`` (default): token_loss = -w_t A_t (1 + logp_t - sg(logp_t)), value -w_t A_t
    (-A_t at the old policy, the value convention of every rule in fspo/clipping); ``value="verl"``:
    token_loss = -w_t A_t logp_t, verl's value (the registry's ``cispo`` uses it). Same gradient.
    Settings: ``clip_ratio_low`` in [0, 1] (1: no floor on the weight, MiniMax-M1's choice: "we did
    not impose a lower bound"), ``clip_ratio_high`` >= 0 (0.28, DAPO's clip-higher; the paper tunes it).
    Masks (per token, A_t != 0): ``clip_upper`` r_t > 1 + high (weight capped), ``clip_lower``
    r_t < 1 - low (weight floored); no dual. These mark a bounded weight, not a zero gradient.
    ``in_band`` (any sign of A): 1 - low <= r_t <= 1 + high. The +-20 clamp changes the weight only
    (never zeroes a gradient), so ``clip_cap`` stays False. Token-level: no closed-form c(L) (as GRPO).
    """

    level = "token"

    def __init__(self, clip_ratio_low: float = CISPOSettings.clip_ratio_low,
                 clip_ratio_high: float = CISPOSettings.clip_ratio_high, value: str = CISPOSettings.value) -> None:
        super().__init__()
        s = CISPOSettings(clip_ratio_low, clip_ratio_high, value, owner=type(self).__name__)
        self.clip_ratio_low, self.clip_ratio_high, self.value = s.clip_ratio_low, s.clip_ratio_high, s.value

    def forward(self, log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor,
                response_mask: Tensor) -> ClipResult:
        p, d, adv, ratio = token_ratio_inputs(type(self).__name__, log_prob, old_log_prob, advantages,
                                              response_mask)
        clipped = torch.clamp(ratio, 1.0 - self.clip_ratio_low, 1.0 + self.clip_ratio_high)
        w = clipped.detach()
        lp = torch.where(p.mask, p.log_prob, 0.0)  # padding may hold -inf: keep grads finite
        factor = lp if self.value == "verl" else 1.0 + lp - lp.detach()
        return weight_clip_result(-w * adv * factor, d, ratio, ratio.detach() == w, adv, p)

    def extra_repr(self) -> str:
        return f"clip_ratio_low={self.clip_ratio_low}, clip_ratio_high={self.clip_ratio_high}, value={self.value}"


@register_policy_loss("cispo")
def policy_loss_cispo(old_log_prob, log_prob, advantages, response_mask,
                      loss_agg_mode: str = "token-mean", config: Any = None):
    """verl's ``cispo``: `CISPOClip(value="verl")` (defaults low 1.0, high 0.28; ``clip_ratio`` fills
    unset sides) + `aggregate` with ``loss_agg_mode`` and verl's batch info. Metrics as verl's:
    ``actor/pg_clipfrac`` = token share with r != clip(r) (any A), ``actor/pg_clipfrac_lower`` = 0."""
    kw = _ratio_kwargs(config, {"clip_ratio_low": 1.0, "clip_ratio_high": 0.28})
    rule = CISPOClip(**kw, value="verl")
    return _run(rule, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                metrics_fn=lambda res, m: {"actor/pg_clipfrac": _masked_mean(~res.in_band, m)})
