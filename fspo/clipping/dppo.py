"""DPPO (arXiv 2602.04879, "Rethinking the Trust Region in LLM RL"): a divergence trust region per token;
registry names ``dppo_tv`` / ``dppo_kl`` (verl 0.9.1's, tests/test_verl_parity.py).
"""
from __future__ import annotations

from typing import Any, Dict, Tuple

import torch
from torch import Tensor

from fspo.clipping._common import (
    MAX_LOG_RATIO,
    Prepared,
    seq_result,
    token_ratio_inputs,
)
from fspo.clipping.base import ClipResult, ClipRule
from fspo.clipping.settings import DIVERGENCES, DPPOSettings  # noqa: F401  (DIVERGENCES: this rule's names)

#: verl's epsilon in the binary KL
KL_EPS = 1e-8


def binary_divergence(kind: str, log_prob: Tensor, old_log_prob: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """(D_t, p_t, q_t), p = e^{logp_new}, q = e^{logp_old} (detached), verl's forms: ``tv`` D_t = p - q (signed);
    ``kl`` D_t = q log(q / p) + (1 - q) log((1 - q + 1e-8) / (1 - p + 1e-8))."""
    lp, lq = log_prob.detach(), old_log_prob.detach()
    p, q = torch.exp(lp), torch.exp(lq)
    if kind == "tv":
        return p - q, p, q
    return q * (lq - lp) + (1 - q) * torch.log((1.0 - q + KL_EPS) / (1.0 - p + KL_EPS)), p, q


def dppo_weighted_loss(p: Prepared, adv: Tensor, ratio: Tensor, valid: Tensor, clip_c: float, value: str) -> Tensor:
    """-A_t sg(min(r_t, C)) valid_t times logp_t (``verl``) or 1 + logp_t - sg(logp_t) (``surrogate``): gradient
    -A_t min(r_t, C) on valid tokens, 0 elsewhere."""
    w = torch.clamp(ratio, max=clip_c).detach() * valid.float()
    lp = torch.where(p.mask, p.log_prob, 0.0)  # padding may hold -inf: keep grads finite
    factor = lp if value == "verl" else 1.0 + lp - lp.detach()
    return -adv * w * factor


def mask_result(loss: Tensor, d: Tensor, adv: Tensor, valid: Tensor, in_band: Tensor, p: Prepared) -> ClipResult:
    """Token-level `ClipResult` of a masking rule: upper where masked with A > 0, lower with A < 0."""
    off, zero = ~valid & p.mask, torch.zeros_like(p.mask)
    return seq_result(loss, d.sum(-1), off & (adv > 0), off & (adv < 0), zero, in_band, zero, p)


class DPPOClip(ClipRule):
    """DPPO-Binary-TV / -KL, verl 0.9.1's ``dppo_tv`` / ``dppo_kl``. With r_t = exp(clamp(d_t, -20, 20)) and D_t
    from `binary_divergence`:

        tv:  valid_t = (p - q <= high)             if A_t > 0, else (p - q >= -low)
        kl:  valid_t = (D_t <= high) or (p <= q)   if A_t > 0, else (D_t <= low) or (p >= q)
        J = sum_t sg(min(r_t, C)) valid_t A_t logp_t

    A token is masked only when it moved past the threshold in its advantage's direction; min(r, C) replaces the
    dual clip. ``value`` as in base.py; ``clip_ratio_low`` / ``clip_ratio_high`` are divergence thresholds.
    ``in_band``: tv -low <= p - q <= high; kl D_t <= (high if p > q else low).
    """

    settings = ("divergence", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "value")
    level = "token"

    def __init__(self, divergence: str = DPPOSettings.divergence, clip_ratio_low: float = DPPOSettings.clip_ratio_low,
                 clip_ratio_high: float = DPPOSettings.clip_ratio_high, clip_ratio_c: float = DPPOSettings.clip_ratio_c,
                 value: str = DPPOSettings.value) -> None:
        super().__init__()
        self._take(DPPOSettings(divergence, clip_ratio_low, clip_ratio_high, clip_ratio_c, value,
                                owner=type(self).__name__))

    def thresholds(self, p: Prepared) -> Tuple[Tensor, Tensor]:
        """(upper, lower) divergence thresholds per token [B, T]."""
        ones = torch.ones_like(p.log_prob)
        return ones * self.clip_ratio_high, ones * self.clip_ratio_low

    def valid(self, p: Prepared, adv: Tensor, div: Tensor, prob: Tensor, old_prob: Tensor
              ) -> Tuple[Tensor, Tensor]:
        """(valid, in_band) [B, T] bool as in the class docstring."""
        hi, lo = self.thresholds(p)
        if self.divergence == "tv":
            up_ok, down_ok = div <= hi, div >= -lo
        else:
            up_ok, down_ok = (div <= hi) | (prob <= old_prob), (div <= lo) | (prob >= old_prob)
        return torch.where(adv > 0, up_ok, down_ok), up_ok & down_ok

    def forward(self, log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor,
                response_mask: Tensor) -> ClipResult:
        p, d, adv, ratio = token_ratio_inputs(type(self).__name__, log_prob, old_log_prob, advantages,
                                              response_mask)
        div, prob, old_prob = binary_divergence(self.divergence, p.log_prob, p.old_log_prob)
        valid, in_band = self.valid(p, adv, div, prob, old_prob)
        loss = dppo_weighted_loss(p, adv, ratio, valid, self.clip_ratio_c, self.value)
        return mask_result(loss, d, adv, valid, in_band, p)


def verl_mask_metrics(res: ClipResult, m: Tensor, rule: DPPOClip, old_log_prob: Tensor, log_prob: Tensor,
                      advantages: Tensor, response_mask: Tensor) -> Dict[str, float]:
    """verl's DPPO metrics: ``actor/pg_clipfrac`` = masked token share (A = 0 takes the A <= 0 test),
    ``actor/pg_clipfrac_lower`` = share of valid tokens with r > C."""
    p, _, adv, ratio = token_ratio_inputs("DPPO metrics", log_prob.detach(), old_log_prob, advantages, response_mask)
    div, prob, old_prob = binary_divergence(rule.divergence, p.log_prob, p.old_log_prob)
    valid, _ = rule.valid(p, adv, div, prob, old_prob)
    raw = torch.exp((p.log_prob - p.old_log_prob).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    return {"actor/pg_clipfrac": _masked_mean(~valid, m),
            "actor/pg_clipfrac_lower": _masked_mean((raw > rule.clip_ratio_c) & valid, m)}


# imported after the rule: the registry imports every rule file, and cppo.py subclasses DPPOClip
from fspo.clipping.registry import _masked_mean, _ratio_kwargs, rule_loss  # noqa: E402


@rule_loss("dppo_tv", metrics=verl_mask_metrics)
def policy_loss_dppo_tv(config: Any) -> ClipRule:
    """verl's ``dppo_tv``: `DPPOClip("tv", value="verl")`; ``clip_ratio*`` are the thresholds."""
    return DPPOClip("tv", **_ratio_kwargs(config, DPPOClip), value="verl")


@rule_loss("dppo_kl", metrics=verl_mask_metrics)
def policy_loss_dppo_kl(config: Any) -> ClipRule:
    """verl's ``dppo_kl``: `DPPOClip("kl", value="verl")`; ``clip_ratio*`` are the thresholds."""
    return DPPOClip("kl", **_ratio_kwargs(config, DPPOClip), value="verl")
