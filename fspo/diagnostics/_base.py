"""`DiagnosticMetric`: states keep their declared dtype. torchmetrics guards ``.half()/.float()`` but not
``module.to(dtype)``, which Lightning's ``bf16-true`` applies to the whole module: float64 sums would become
bf16 (inexact past 256). Device moves still apply.
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
        """As `Metric.add_state`, remembering a tensor state's dtype (a list state has none)."""
        super().add_state(name, default, dist_reduce_fx=dist_reduce_fx, persistent=persistent)
        if not hasattr(self, "_state_dtypes"):
            self._state_dtypes: Dict[str, torch.dtype] = {}
        if isinstance(default, torch.Tensor):
            self._state_dtypes[name] = default.dtype

    def _apply(self, fn: Callable, exclude_state: Sequence[str] = ""):
        this = super()._apply(fn, exclude_state)
        for key, dtype in getattr(this, "_state_dtypes", {}).items():
            cur = getattr(this, key)
            if cur.dtype != dtype:
                setattr(this, key, cur.to(dtype))
                this._defaults[key] = this._defaults[key].to(dtype)
        return this
