"""VESPO (arXiv 2602.10693; TRL ``loss_type="vespo"``): a smooth gamma kernel on the sequence's IS weight. verl
0.9.1 has none; the equation is the authors' verl recipe (github.com/FloyedShen/VESPO) and TRL's
``get_gamma_weights``, pinned by hand in tests/test_clip_divergence_rules.py.
"""
from __future__ import annotations

import math
from typing import Any, Tuple

import numpy as np
import torch
from scipy.optimize import brentq
from torch import Tensor

from fspo.clipping._common import (
    MAX_LOG_RATIO,
    prepare,
    seq_advantage,
    seq_result,
    token_advantage,
    token_log_ratio,
)
from fspo.clipping.base import ClipResult, ClipRule
from fspo.clipping.registry import _get, rule_loss
from fspo.clipping.settings import LENGTH_SCALES, VESPOSettings  # noqa: F401  (LENGTH_SCALES: this rule's names)

#: a sequence counts as clipped below this log weight
LOG_HALF = math.log(0.5)
#: the recipe's and TRL's floors on w and lambda
LOG_W_FLOOR, LAMBDA_FLOOR = math.log(1e-8), 1e-4


def log_kernel(x, k: float, lam: float):
    """log phi(e^x) = lam + k x - lam e^x: the gamma kernel phi(w) = w^k e^{lam (1 - w)}, phi(1) = 1."""
    return lam + k * x - lam * (torch.exp(x) if isinstance(x, Tensor) else np.exp(x))


def vespo_band(k: float, lam: float) -> Tuple[float, float]:
    """(x_lo, x_hi): where phi(e^x) >= 1/2 (log phi is concave, 0 at x = 0); -inf when k = 0, +inf when lam = 0."""
    f = lambda x: float(log_kernel(x, k, lam)) - LOG_HALF  # noqa: E731
    top = math.log(k / lam) if k > 0 and lam > 0 else (0.0 if k == 0 else math.inf)

    def root(start: float, step: float) -> float:
        a, b = start, start + step
        while f(b) >= 0:
            a, b = b, b + step
            step *= 2
            if abs(b) > 1e3:
                return math.copysign(math.inf, step)
        return brentq(f, min(a, b), max(a, b), xtol=1e-14)

    lo = -math.inf if k == 0 else root(min(0.0, top), -1.0)
    hi = math.inf if lam == 0 else root(max(0.0, top) if math.isfinite(top) else 0.0, 1.0)
    return lo, hi


class VESPOClip(ClipRule):
    """VESPO's soft sequence-level reweighting (REINFORCE form), as the recipe and TRL. S_i = sum_t clamp(d_t, -20,
    20), x_i = clamp(S_i, log 1e-8, 20), (k, lam) = (k_pos, max(lambda_pos, 1e-4)) if A_i >= 0 else the _neg pair:

        phi_i = sg(w_i^k e^{lam (1 - w_i)}),  w_i = e^{x_i},    J = sum_t phi_i A_t logp_t

    phi(1) = 1, phi -> 0 as w -> 0 (k > 0) and w -> inf (lam > 0). ``value`` (base.py): ``verl`` -phi_i A_t logp_t,
    ``surrogate`` -phi_i A_t (1 + logp_t - sg(logp_t)). Defaults: TRL's and the recipe's code.
    ``length_scale="sqrt"`` (ours): x_i = clamp(S_i sqrt(ref_length / L_i), ...), the same spread at every length
    (FSPO's argument); VESPO at L = ref_length. Diagnostics per sequence: clipped where phi_i < 1/2, upper / lower
    where x_i is above / below `vespo_band` (A != 0); no dual, no cap.
    """

    settings = ("k_pos", "lambda_pos", "k_neg", "lambda_neg", "value", "length_scale", "ref_length")
    level = "sequence"

    def __init__(self, k_pos: float = VESPOSettings.k_pos, lambda_pos: float = VESPOSettings.lambda_pos,
                 k_neg: float = VESPOSettings.k_neg, lambda_neg: float = VESPOSettings.lambda_neg,
                 value: str = VESPOSettings.value, length_scale: str = VESPOSettings.length_scale,
                 ref_length: float = VESPOSettings.ref_length) -> None:
        super().__init__()
        self._take(VESPOSettings(k_pos, lambda_pos, k_neg, lambda_neg, value, length_scale, ref_length,
                                 owner=type(self).__name__))

    def kernel_input(self, s: Tensor, lengths: Tensor) -> Tensor:
        """x_i: S_i, or S_i sqrt(ref_length / L_i) with ``length_scale="sqrt"``, clamped to [log 1e-8, 20]."""
        if self.length_scale == "sqrt":
            s = s * torch.sqrt(self.ref_length / lengths.clamp(min=1.0))
        return s.clamp(LOG_W_FLOOR, MAX_LOG_RATIO)

    def forward(self, log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor,
                response_mask: Tensor) -> ClipResult:
        p = prepare(type(self).__name__, log_prob, old_log_prob, advantages, response_mask)
        d = token_log_ratio(p).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        s = d.sum(-1).detach()
        x = self.kernel_input(s, p.lengths)
        a_seq = seq_advantage(advantages, p)
        pos = a_seq >= 0
        k = torch.where(pos, self.k_pos, self.k_neg)
        lam = torch.where(pos, self.lambda_pos, self.lambda_neg).clamp(min=LAMBDA_FLOOR)
        log_phi = log_kernel(x, k, lam)
        phi = torch.nan_to_num(torch.exp(log_phi), nan=0.0, posinf=0.0, neginf=0.0)
        adv = token_advantage(advantages, p)
        lp = torch.where(p.mask, p.log_prob, 0.0)  # padding may hold -inf: keep grads finite
        factor = lp if self.value == "verl" else 1.0 + lp - lp.detach()
        loss = -phi.unsqueeze(-1) * adv * factor
        ok = log_phi >= LOG_HALF
        bind = ~ok & (a_seq != 0)
        zero = torch.zeros_like(ok)
        return seq_result(loss, s, bind & (x > 0), bind & (x < 0), zero, ok, zero, p)

    def theory_clip_fraction(self, lengths, sigma: float):
        """c(L) = P(phi < 1/2), S ~ N(0, sigma^2 L), averaged over the two signs of A: grows with L as RLOO's; flat as
        FSPO's with ``length_scale="sqrt"``."""
        from fspo.clipping.theory import c_fspo, c_rloo
        out = 0.0
        for k, lam in ((self.k_pos, self.lambda_pos), (self.k_neg, self.lambda_neg)):
            lo, hi = vespo_band(k, max(lam, LAMBDA_FLOOR))
            if self.length_scale == "sqrt":
                r = math.sqrt(self.ref_length)
                out = out + 0.5 * c_fspo(lengths, sigma, min(hi / r, 1e6), min(-lo / r, 1e6))
            else:
                out = out + 0.5 * c_rloo(lengths, sigma, math.expm1(min(hi, 700.0)), min(-math.expm1(lo), 1.0 - 1e-15))
        return out


VESPO_KEYS = ("k_pos", "lambda_pos", "k_neg", "lambda_neg", "length_scale", "ref_length")


@rule_loss("vespo")
def policy_loss_vespo(config: Any) -> ClipRule:
    """VESPO: `VESPOClip(value="verl")`, config ``k_pos``, ``lambda_pos``, ``k_neg``, ``lambda_neg`` (also under
    ``config.policy_loss.vespo``, the recipe's place)."""
    sub = _get(_get(config, "policy_loss"), "vespo")
    kw = {key: (_get(sub, key) if _get(sub, key) is not None else _get(config, key)) for key in VESPO_KEYS}
    return VESPOClip(**{k: v for k, v in kw.items() if v is not None}, value="verl")
