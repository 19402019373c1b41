"""Per-length-bin counts of one loss call, for host trainers (verl, TRL). Sums, not fractions: hosts average
metrics over micro-batches, and averaged sums keep their ratios. Rows per bin (``ROWS``): ``seq`` sequences,
``clip`` sum_i f_i (f_i the sequence's binding-clip share of tokens), ``out`` sum_i (1 - g_i) (g_i its
in-band share: the paper's c(L)).
"""
from __future__ import annotations

from typing import Dict

import torch
from torch import Tensor

from fspo.clipping.base import ClipResult
from fspo.diagnostics.bins import LengthBins

ROWS = ("seq", "clip", "out")
BIN_WIDTH = 200  # the adapters' length bins, in tokens


def length_counts(result: ClipResult, response_mask: Tensor, bins: LengthBins) -> Tensor:
    """[3, n_bins] float32 sums (rows ``ROWS``) of one batch, on the mask's device, detached."""
    m = response_mask.bool()
    lengths = m.sum(-1)
    den = lengths.clamp(min=1).float()
    clip = (result.clipped & m).sum(-1).float() / den
    out = 1.0 - (result.in_band & m).sum(-1).float() / den
    idx = bins.index(lengths)
    keep = idx >= 0
    sums = torch.zeros(len(ROWS), bins.n_bins, dtype=torch.float32, device=m.device)
    for row, values in enumerate((torch.ones_like(den), clip, out)):
        sums[row].index_add_(0, idx[keep], values[keep].detach())
    return sums


def count_metrics(sums: Tensor, bins: LengthBins, prefix: str) -> Dict[str, float]:
    """``{prefix}/n_{row}/{label}`` for every row and every bin (a fixed key set, so a host averaging key by key
    sees each key every call)."""
    values = sums.detach().cpu().tolist()
    return {f"{prefix}/n_{row}/{label}": float(values[r][b])
            for r, row in enumerate(ROWS) for b, label in enumerate(bins.labels)}


def fractions(sums: Tensor, bins: LengthBins) -> Dict[str, Dict[str, float]]:
    """``{"clip": {label: clip/seq}, "out": {label: out/seq}}`` over the bins with sequences."""
    values = sums.detach().cpu().tolist()
    out: Dict[str, Dict[str, float]] = {"clip": {}, "out": {}}
    for b, label in enumerate(bins.labels):
        n = values[0][b]
        if n > 0:
            out["clip"][label] = values[1][b] / n
            out["out"][label] = values[2][b] / n
    return out
