"""`SequenceLedger`: one record per measured sequence (a torchmetrics Metric with ``cat`` states: joined across
ranks on `compute()`, saved in checkpoints), for the tests that need sequences rather than binned sums
(other bands, cluster bootstraps, out-of-sample fits). Columns (float64):

    step, update   RL step; mini-batch index in it (0, the on-policy one, is never recorded; -1 the gate's)
    group          prompt index in the step's batch (the bootstrap resamples (step, group) clusters)
    length, s, d2  L; S = sum_t d_t, d_t = log pi_current - log pi_old; sum_t d_t^2
    adv, out       the advantage; the share of tokens outside the run's own band
"""
from __future__ import annotations

import csv
from pathlib import Path
from typing import Dict

import numpy as np
import torch
from torch import Tensor

from fspo.diagnostics._base import DiagnosticMetric

COLUMNS = ("step", "update", "group", "length", "s", "d2", "adv", "out")


class SequenceLedger(DiagnosticMetric):
    """Per-sequence records (module docstring); `update` takes one micro-batch's tensors."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state("rows", default=[], dist_reduce_fx="cat")

    @torch.no_grad()
    def update(self, step: int, update: int, group_ids: Tensor, lengths: Tensor, token_log_ratio: Tensor,
               response_mask: Tensor, advantages: Tensor, in_band: Tensor) -> None:
        """Record a micro-batch: ``token_log_ratio`` [B, T] (0 on padding), ``response_mask`` [B, T], ``advantages``
        [B] or [B, T], ``in_band`` [B, T] bool."""
        m = response_mask.to(torch.float64)
        d = token_log_ratio.to(torch.float64) * m
        L = m.sum(-1)
        adv = advantages.to(torch.float64)
        if adv.dim() == 2:
            adv = (adv * m).sum(-1) / L.clamp(min=1)
        out = ((~in_band.bool()).to(torch.float64) * m).sum(-1) / L.clamp(min=1)
        B = d.shape[0]
        g = group_ids.to(torch.float64) if group_ids is not None else torch.full((B,), -1.0, dtype=torch.float64)
        row = torch.stack([torch.full((B,), float(step), dtype=torch.float64), torch.full((B,), float(update),
                           dtype=torch.float64), g.cpu(), lengths.to(torch.float64).cpu(), d.sum(-1).cpu(),
                           (d * d).sum(-1).cpu(), adv.cpu(), out.cpu()], 1)
        self.rows.append(row.to(self.device) if self.device.type != "cpu" else row)

    def compute(self) -> Tensor:
        rows = self.rows
        if isinstance(rows, list):
            return torch.cat(rows) if rows else torch.zeros(0, len(COLUMNS), dtype=torch.float64)
        return rows


def ledger_arrays(rows: Tensor) -> Dict[str, np.ndarray]:
    """{column: numpy array} of a `SequenceLedger.compute()` result."""
    a = rows.detach().cpu().numpy().reshape(-1, len(COLUMNS))
    return {c: a[:, j] for j, c in enumerate(COLUMNS)}


def write_csv(rows: Tensor, path: Path) -> Path:
    """The records as CSV with a header (``COLUMNS``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(COLUMNS)
        for r in rows.detach().cpu().numpy().reshape(-1, len(COLUMNS)):
            w.writerow([int(x) if j < 4 else f"{x:.9g}" for j, x in enumerate(r)])
    return path


def read_csv(path: Path) -> Dict[str, np.ndarray]:
    """`write_csv`'s file back as {column: numpy array}."""
    a = np.loadtxt(path, delimiter=",", skiprows=1, ndmin=2)
    return {c: (a[:, j] if len(a) else np.zeros(0)) for j, c in enumerate(COLUMNS)}
