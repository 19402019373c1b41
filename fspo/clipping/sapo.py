"""SAPO (Qwen, arXiv 2511.20347): a smooth sigmoid gate on the token ratio instead of a hard clip."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from fspo.clipping._common import token_ratio_inputs, weight_clip_result
from fspo.clipping.base import ClipResult, ClipRule
from fspo.clipping.registry import _get, rule_loss
from fspo.clipping.settings import SAPOSettings

#: |tau (r - 1)| where the gate's weight 4 s (1 - s) falls to 1/2
HALF_WEIGHT = 2.0 * math.asinh(1.0)


class SAPOClip(ClipRule):
    """SAPO's soft-gated token objective, verl 0.9.1's ``sapo``: r_t = exp(clamp(d_t, -20, 20)), tau_t = tau_pos if
    A_t > 0 else tau_neg, f(r) = (4 / tau) sigmoid(tau (r - 1)),

        J = f(r_t) A_t,    d loss_t / d logp_t = -A_t r_t w_t,   w_t = 4 s (1 - s),  s = sigmoid(tau_t (r_t - 1)).

    ``value`` as in base.py (surrogate: -A_t (f(r_t) - 2 / tau_t + 1)). Diagnostics: clipped where w_t < 1/2,
    |r_t - 1| > 2 asinh(1) / tau_t; upper / lower above / below r = 1 (A_t != 0); no dual, no cap.
    """

    settings = ("tau_pos", "tau_neg", "value")
    level = "token"

    def __init__(self, tau_pos: float = SAPOSettings.tau_pos, tau_neg: float = SAPOSettings.tau_neg,
                 value: str = SAPOSettings.value) -> None:
        super().__init__()
        self._take(SAPOSettings(tau_pos, tau_neg, value, owner=type(self).__name__))

    def forward(self, log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor,
                response_mask: Tensor) -> ClipResult:
        p, d, adv, ratio = token_ratio_inputs(type(self).__name__, log_prob, old_log_prob, advantages,
                                              response_mask)
        tau = torch.where(adv > 0, self.tau_pos, self.tau_neg)
        gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
        if self.value == "surrogate":
            gate = gate - 2.0 / tau + 1.0
        in_band = (tau * (ratio.detach() - 1.0)).abs() <= HALF_WEIGHT
        return weight_clip_result(-gate * adv, d, ratio, in_band, adv, p)


@rule_loss("sapo", mode="seq-mean-token-mean", default_mode="seq-mean-token-mean",
           metrics=lambda res, m, *_: {"actor/pg_clipfrac": 0.0, "actor/pg_clipfrac_lower": 0.0})
def policy_loss_sapo(config: Any) -> ClipRule:
    """verl's ``sapo``: `SAPOClip(value="verl")` with config ``tau_pos`` / ``tau_neg``, aggregated with
    seq-mean-token-mean whatever ``loss_agg_mode`` says, as verl; clip fractions 0."""
    kw = {k: _get(config, k) for k in ("tau_pos", "tau_neg")}
    return SAPOClip(**{k: v for k, v in kw.items() if v is not None}, value="verl")
