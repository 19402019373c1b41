"""CPPO (arXiv 2606.10968, "Beyond Uniform Token-Level Trust Region"): DPPO's divergence mask with
position-weighted thresholds and a cumulative prefix budget. The paper gives no code; this reading is
pinned by hand in tests/test_clip_divergence_rules.py.
"""
from __future__ import annotations

from typing import Any, Tuple

import torch
from torch import Tensor

from fspo.clipping._common import Prepared
from fspo.clipping.base import ClipRule
from fspo.clipping.dppo import DPPOClip, verl_mask_metrics
from fspo.clipping.registry import _get, _ratio_kwargs, rule_loss
from fspo.clipping.settings import BUDGETS, CPPOSettings  # noqa: F401  (BUDGETS: this rule's names)


def positions(p: Prepared) -> Tuple[Tensor, Tensor]:
    """(t, max(L - 1, 1)): each response token's 0-based index among its sequence's, [B, T] and [B, 1]."""
    t = torch.cumsum(p.maskf, -1) - 1.0
    return t.clamp(min=0.0), (p.lengths - 1.0).clamp(min=1.0).unsqueeze(-1)


class CPPOClip(DPPOClip):
    """CPPO's token mask over `DPPOClip` (same D_t, IS weight and gradient), our reading of arXiv 2606.10968:

      position weight  w_t = 1 - (1 - w_min) t / max(L - 1, 1); the thresholds become high / w_t, low / w_t;
      prefix budget    B_t = (1 / (t + 1)) sum_{s <= t} w_s |D_s|; a token that moved in its advantage's
                       direction is also masked when B_t > high (A > 0) or B_t > low (A < 0).

    ``budget="none"`` with ``w_min=1`` is DPPO exactly. ``in_band``: the positional band and the budget.
    """

    settings = DPPOClip.settings + ("w_min", "budget")

    def __init__(self, divergence: str = CPPOSettings.divergence, clip_ratio_low: float = CPPOSettings.clip_ratio_low,
                 clip_ratio_high: float = CPPOSettings.clip_ratio_high, w_min: float = CPPOSettings.w_min,
                 budget: str = CPPOSettings.budget, clip_ratio_c: float = CPPOSettings.clip_ratio_c,
                 value: str = CPPOSettings.value) -> None:
        ClipRule.__init__(self)
        self._take(CPPOSettings(divergence=divergence, clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high,
                                clip_ratio_c=clip_ratio_c, value=value, w_min=w_min, budget=budget,
                                owner=type(self).__name__))

    def weights(self, p: Prepared) -> Tensor:
        """w_t [B, T] (1 on padding)."""
        t, den = positions(p)
        return torch.where(p.mask, 1.0 - (1.0 - self.w_min) * t / den, 1.0)

    def thresholds(self, p: Prepared) -> Tuple[Tensor, Tensor]:
        w = self.weights(p)
        return self.clip_ratio_high / w, self.clip_ratio_low / w

    def prefix_budget(self, p: Prepared, div: Tensor) -> Tensor:
        """B_t [B, T] over the sequence's response tokens."""
        t, _ = positions(p)
        spent = torch.cumsum(torch.where(p.mask, self.weights(p) * div.abs(), 0.0), -1)
        return spent / (t + 1.0)

    def valid(self, p: Prepared, adv: Tensor, div: Tensor, prob: Tensor, old_prob: Tensor):
        valid, in_band = super().valid(p, adv, div, prob, old_prob)
        if self.budget == "none":
            return valid, in_band
        b = self.prefix_budget(p, div)
        up, down = prob > old_prob, prob < old_prob
        budget_ok = torch.where(adv > 0, (b <= self.clip_ratio_high) | ~up, (b <= self.clip_ratio_low) | ~down)
        band_ok = torch.where(up, b <= self.clip_ratio_high, b <= self.clip_ratio_low)
        return valid & budget_ok, in_band & band_ok


@rule_loss("cppo", metrics=verl_mask_metrics)
def policy_loss_cppo(config: Any) -> ClipRule:
    """CPPO: `CPPOClip(value="verl")`, config as DPPO's plus ``divergence``, ``w_min``, ``budget``."""
    extra = {k: _get(config, k) for k in ("divergence", "w_min", "budget") if _get(config, k) is not None}
    return CPPOClip(**_ratio_kwargs(config, CPPOClip), **extra, value="verl")
