"""Per-length-bin counts of one loss call, for trainers we do not own (verl, TRL).

Owns: `length_counts` (a `ClipResult` and its mask -> a [3, n_bins] tensor of sums) and
`count_metrics` / `fractions` (those sums as flat metric dicts). Leaves out: the running,
checkpointed per-run metrics of our own trainer (clip_fraction.py) and where the adapters put the
numbers (fspo/integrations).

Sums, not fractions, because the host trainers average metrics over micro-batches: sums averaged
over any number of calls keep their ratios, so fraction = clipped / sequences is exact after the
host's averaging as long as every sum went through the same averaging. Rows (``ROWS``), per bin b
(bins.py; L = 0 rows are in no bin):

    seq    number of sequences with L_i in b
    clip   sum_i f_i,  f_i = sum_t clipped[i, t] m_it / L_i   (binding clip: upper | lower | dual)
    out    sum_i (1 - g_i),  g_i = sum_t in_band[i, t] m_it / L_i   (out of the band: the paper's c(L))

f_i and g_i are 0 or 1 for sequence-level rules such as FSPO, fractional for token-level rules.
"""
from __future__ import annotations

from typing import Dict

import torch
from torch import Tensor

from fspo.clipping.base import ClipResult
from fspo.diagnostics.bins import LengthBins

ROWS = ("seq", "clip", "out")


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
    """``{prefix}/n_{row}/{label}: sums[row, b]`` for every row and EVERY bin (a fixed key set, so a
    host that averages key by key over micro-batches and ranks sees each key every call)."""
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
