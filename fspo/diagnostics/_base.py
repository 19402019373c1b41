"""Base class of the diagnostics metrics: states keep the dtype they were declared with.

Owns: `DiagnosticMetric`. Why: torchmetrics guards ``.half()/.float()/.double()`` but not
``module.to(dtype)``, and Lightning's ``precision="bf16-true"`` converts the whole LightningModule
with ``module.to(dtype=torch.bfloat16)``; float64 sum states would silently become bf16 (8 bits of
mantissa: counts and sums stop being exact after 256). Device moves still apply as usual.
"""
from __future__ import annotations

from typing import Callable, Dict, Sequence

import torch
from torchmetrics import Metric


class DiagnosticMetric(Metric):
    """`Metric` whose tensor states keep their declared dtype under any ``_apply`` (device moves kept)."""

    full_state_update = False
    is_differentiable = False
    higher_is_better = None

    def add_state(self, name: str, default, dist_reduce_fx=None, persistent: bool = False) -> None:
        """As `Metric.add_state`, and remember the state's dtype."""
        super().add_state(name, default, dist_reduce_fx=dist_reduce_fx, persistent=persistent)
        if not hasattr(self, "_state_dtypes"):
            self._state_dtypes: Dict[str, torch.dtype] = {}
        self._state_dtypes[name] = default.dtype

    def _apply(self, fn: Callable, exclude_state: Sequence[str] = ""):
        this = super()._apply(fn, exclude_state)
        for key, dtype in getattr(this, "_state_dtypes", {}).items():
            cur = getattr(this, key)
            if cur.dtype != dtype:
                setattr(this, key, cur.to(dtype))
                this._defaults[key] = this._defaults[key].to(dtype)
        return this
