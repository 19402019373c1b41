"""Rollout length statistics (paper: overlong rate and mean length excluding overlong), exact across ranks."""
from __future__ import annotations

from typing import Dict

import torch
from torch import Tensor

from fspo.diagnostics._base import DiagnosticMetric
from fspo.diagnostics.bins import check_lengths


class RolloutLengthStats(DiagnosticMetric):
    """Over every completion seen (L = 0 included), ``update(lengths [B], overlong [B] bool)``; ``compute()``:
    ``rollout/overlong_rate``, ``rollout/response_len_mean``, ``rollout/response_len_mean_excl_overlong``,
    ``rollout/response_len_max``, ``rollout/n_responses``; keys with a zero denominator omitted."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        for name in ("n", "n_overlong", "len_sum", "len_sum_not_overlong"):
            self.add_state(name, torch.zeros((), dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("len_max", torch.zeros((), dtype=torch.long), dist_reduce_fx="max")

    def update(self, lengths: Tensor, overlong: Tensor) -> None:
        """Add one batch of completion lengths and overlong flags."""
        lengths = check_lengths(lengths).to(self.n.device)
        ov = torch.as_tensor(overlong, device=lengths.device)
        if ov.shape != lengths.shape:
            raise ValueError(f"overlong shape {tuple(ov.shape)} != lengths shape {tuple(lengths.shape)}")
        if ov.dtype != torch.bool:
            if ov.numel() and ((ov != 0) & (ov != 1)).any():
                raise ValueError("overlong must be bool (or 0/1)")
            ov = ov.bool()
        if lengths.numel() == 0:
            return
        self.n += lengths.numel()
        self.n_overlong += ov.sum()
        self.len_sum += lengths.sum()
        self.len_sum_not_overlong += lengths[~ov].sum()
        self.len_max = torch.maximum(self.len_max, lengths.max())

    def compute(self) -> Dict[str, float]:
        """``rollout/*`` floats (class docstring)."""
        n = int(self.n)
        if n == 0:
            return {}
        out = {
            "rollout/overlong_rate": int(self.n_overlong) / n,
            "rollout/response_len_mean": int(self.len_sum) / n,
            "rollout/response_len_max": float(self.len_max),
            "rollout/n_responses": float(n),
        }
        n_ok = n - int(self.n_overlong)
        if n_ok > 0:
            out["rollout/response_len_mean_excl_overlong"] = int(self.len_sum_not_overlong) / n_ok
        return out
