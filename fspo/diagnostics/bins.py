"""Length bins for the diagnostics, and the input checks the metrics share. Bins are half-open
``[e_k, e_{k+1})`` plus the overflow ``[e_last, inf)`` (``n_bins == len(edges)``); L = 0 and L < edges[0]
map to -1, no bin.
"""
from __future__ import annotations

import math
import re
from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

_LABEL_RE = re.compile(r"^len_(\d+)_(\d+|inf)$")


class LengthBins:
    """``LengthBins(width=200, max_len=32768)`` (edges 0, w, 2w, ..., max_len) or ``LengthBins(edges=[...])``
    (non-negative integers, strictly increasing). Labels ``len_00200_00400`` / ``len_32768_inf`` (MLflow-safe)."""

    def __init__(self, width: int = 200, max_len: int = 32768,
                 edges: Optional[Sequence[int]] = None) -> None:
        if edges is None:
            if not isinstance(width, int) or width <= 0:
                raise ValueError(f"LengthBins: width must be a positive int, got {width!r}")
            if not isinstance(max_len, int) or max_len <= 0:
                raise ValueError(f"LengthBins: max_len must be a positive int, got {max_len!r}")
            edges = list(range(0, max_len, width)) + [max_len]
        edges = list(edges)
        if len(edges) == 0:
            raise ValueError("LengthBins: edges must hold at least one value, e.g. edges=[0, 200, 400]")
        for e in edges:
            if isinstance(e, bool) or not float(e).is_integer():
                raise ValueError(f"LengthBins: edges must be integers (token counts), got {e!r} in {edges}")
        edges = [int(e) for e in edges]
        if edges[0] < 0:
            raise ValueError(f"LengthBins: edges must be non-negative, got first edge {edges[0]}")
        bad = [i for i in range(1, len(edges)) if edges[i] <= edges[i - 1]]
        if bad:
            i = bad[0]
            raise ValueError(
                f"LengthBins: edges must be strictly increasing, but edges[{i - 1}]={edges[i - 1]} "
                f">= edges[{i}]={edges[i]}; sort them and drop duplicates"
            )
        self.edges: Tuple[int, ...] = tuple(edges)
        self._edges_t = torch.tensor(self.edges, dtype=torch.long)

    @property
    def n_bins(self) -> int:
        """Number of bins, the overflow bin included."""
        return len(self.edges)

    @property
    def upper(self) -> List[float]:
        """Upper edge of each bin (``inf`` for the overflow bin)."""
        return [float(e) for e in self.edges[1:]] + [math.inf]

    @property
    def labels(self) -> List[str]:
        """MLflow-safe label of each bin."""
        out = [f"len_{lo:05d}_{hi:05d}" for lo, hi in zip(self.edges[:-1], self.edges[1:])]
        return out + [f"len_{self.edges[-1]:05d}_inf"]

    def index(self, lengths: Tensor) -> Tensor:
        """Bin index of each length (LongTensor like ``lengths``); -1 for L <= 0 or L < edges[0]."""
        lengths = torch.as_tensor(lengths)
        edges = self._edges_t.to(lengths.device)
        idx = torch.bucketize(lengths.long(), edges, right=True) - 1
        return torch.where(lengths > 0, idx, torch.full_like(idx, -1))

    def __repr__(self) -> str:
        e = self.edges
        shown = f"{list(e[:3])}...{e[-1]}" if len(e) > 6 else str(list(e))
        return f"LengthBins(edges={shown}, n_bins={self.n_bins})"


def label_edges(label: str) -> Tuple[float, float]:
    """Inverse of `LengthBins.labels`: ``"len_00200_00400" -> (200.0, 400.0)``, ``inf`` kept."""
    m = _LABEL_RE.match(label)
    if m is None:
        raise ValueError(f"not a length-bin label: {label!r} (expected e.g. 'len_00200_00400')")
    return float(m.group(1)), (math.inf if m.group(2) == "inf" else float(m.group(2)))


def bin_midpoint(label: str) -> float:
    """Where a bin is drawn: its midpoint; the overflow bin at its lower edge."""
    lo, hi = label_edges(label)
    return lo if math.isinf(hi) else (lo + hi) / 2


def check_finite(name: str, x: Tensor, hint: str = "check the inputs upstream") -> None:
    """Raise ``ValueError("<name> contains NaN at k positions; <hint>")`` (or inf) if not finite."""
    if not torch.is_floating_point(x) or x.numel() == 0:
        return
    n_nan = int(torch.isnan(x).sum())
    if n_nan:
        raise ValueError(f"{name} contains NaN at {n_nan} positions; {hint}")
    n_inf = int(torch.isinf(x).sum())
    if n_inf:
        raise ValueError(f"{name} contains inf at {n_inf} positions; {hint}")


def check_lengths(lengths: Tensor, name: str = "lengths") -> Tensor:
    """Validate a [B] tensor of token counts (finite, integral, >= 0) and return it as long."""
    lengths = torch.as_tensor(lengths)
    if lengths.dim() != 1:
        raise ValueError(f"{name} must have shape [B], got {tuple(lengths.shape)}")
    if torch.is_floating_point(lengths):
        check_finite(name, lengths, "lengths must be token counts")
        if lengths.numel() and (lengths != lengths.round()).any():
            raise ValueError(f"{name} must hold whole token counts, got fractional values")
    if lengths.numel() and (lengths < 0).any():
        raise ValueError(f"{name} contains {int((lengths < 0).sum())} negative values; lengths are token counts >= 0")
    return lengths.long()
