"""SAPO (Qwen, arXiv 2511.20347): a smooth sigmoid gate on the token ratio instead of a hard clip.

Owns: `SAPOClip` and the registry name ``sapo`` (verl 0.9.1's `compute_policy_loss_sapo`,
tests/test_verl_parity.py). Leaves out: aggregation (fspo/losses.py; SAPO and verl use
seq-mean-token-mean, conf/method/sapo.yaml).
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from fspo.clipping._common import token_ratio_inputs, weight_clip_result
from fspo.clipping.base import ClipResult, ClipRule
from fspo.clipping.registry import _get, _run, register_policy_loss
from fspo.clipping.settings import SAPOSettings

#: |tau (r - 1)| at which the gate's gradient weight 4 sigma (1 - sigma) falls to 1/2: 2 asinh(1) = 1.7627
HALF_WEIGHT = 2.0 * math.asinh(1.0)


class SAPOClip(ClipRule):
    """SAPO's soft-gated token objective, exactly verl 0.9.1's ``sapo``.

    Per token: r_t = exp(clamp(logp_new - logp_old, -20, 20)), tau_t = tau_pos if A_t > 0 else tau_neg,
    f(r) = (4 / tau) sigmoid(tau (r - 1)), and

        J = f(r_t) A_t    so    d loss_t / d logp_t = -A_t r_t w_t,   w_t = 4 s (1 - s), s = sigmoid(tau_t (r_t - 1)).

    w_t = 1 at r = 1 (the unclipped PPO gradient there) and decays smoothly as r leaves 1: no token is
    ever cut off. ``value="surrogate"`` (default): token_loss = -A_t (f(r_t) - 2 / tau_t + 1), i.e. -A_t
    at the old policy like every rule here; ``value="verl"``: -A_t f(r_t), verl's value (the registry's
    ``sapo`` uses it). The two differ by a constant per token: same gradient.
    Settings: ``tau_pos``, ``tau_neg`` > 0 (SAPO and verl: 1.0 and 1.05).
    A soft gate has no band; for the diagnostics this rule reads a token as clipped where the gate has
    taken at least half its gradient, w_t < 1/2, i.e. |r_t - 1| > 2 asinh(1) / tau_t = 1.7627 / tau_t
    (our reading, not SAPO's; the loss does not depend on it). ``in_band``: w_t >= 1/2 with the token's
    own tau (any sign of A); ``clip_upper`` / ``clip_lower`` (A_t != 0): out of that band above / below
    r = 1 (below needs tau > 1.7627, since r > 0); no dual, no cap (the +-20 clamp lies far outside).
    Token-level: no closed-form c(L) (as GRPO).
    """

    level = "token"

    def __init__(self, tau_pos: float = SAPOSettings.tau_pos, tau_neg: float = SAPOSettings.tau_neg,
                 value: str = SAPOSettings.value) -> None:
        super().__init__()
        s = SAPOSettings(tau_pos, tau_neg, value, owner=type(self).__name__)
        self.tau_pos, self.tau_neg, self.value = s.tau_pos, s.tau_neg, s.value

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

    def extra_repr(self) -> str:
        return f"tau_pos={self.tau_pos}, tau_neg={self.tau_neg}, value={self.value}"


@register_policy_loss("sapo")
def policy_loss_sapo(old_log_prob, log_prob, advantages, response_mask,
                     loss_agg_mode: str = "seq-mean-token-mean", config: Any = None):
    """verl's ``sapo``: `SAPOClip(tau_pos, tau_neg, value="verl")` (config ``tau_pos`` / ``tau_neg``,
    default 1.0 / 1.05) aggregated with seq-mean-token-mean whatever ``loss_agg_mode`` says, as verl
    0.9.1 does. Metrics as verl's: ``actor/pg_clipfrac`` and ``actor/pg_clipfrac_lower`` are 0."""
    kw = {k: _get(config, k) for k in ("tau_pos", "tau_neg")}
    rule = SAPOClip(**{k: v for k, v in kw.items() if v is not None}, value="verl")
    return _run(rule, old_log_prob, log_prob, advantages, response_mask, "seq-mean-token-mean", config,
                metrics_fn=lambda res, m: {"actor/pg_clipfrac": 0.0, "actor/pg_clipfrac_lower": 0.0})
