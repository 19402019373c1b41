"""The report's by-length view: out-of-band fraction c(L) = 1 - q(L) per length bin and group, the
sequences behind each cell, and how flat each group's curve is over its populated bins.

Owns: `by_length_rows` (per group and bin: c(L) as the mean over runs of each run's run-level
``run/band/out_frac/<bin>``, and the mean per run of ``run/band/n_seq/<bin>``, the sequences
counted for acceptance there), `flatness` (max - min of c(L) over the populated bins: a bin
counts when its mean count per run is >= ``min_count``; the target is "flat within 0.05"), and the
Markdown table. Leaves out: reading MLflow (collect.py), figures (figures.py).

Why counts: a bin with 3 sequences shows 0.00 or 0.67 by chance; the LRE already weighs bins by
their counts, and a flatness read off thin bins says nothing. Runs logged before
``band/n_seq/<bin>`` existed have no counts: their bins are all treated as populated (and the
table says "n=?").
"""
from __future__ import annotations

import math
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from fspo.diagnostics.bins import label_edges
from fspo.evaluation.report.collect import RunRecord

MIN_COUNT = 100  # sequences per run (a run of the length-fairness sweep counts ~3,840 for acceptance)
RUN_COUNT_PREFIX = "run/band/n_seq/"

Cell = Tuple[float, Optional[float]]  # (mean c(L) over runs, mean count per run or None)


def group_by_length(runs: Sequence[RunRecord]) -> Dict[str, Cell]:
    """{bin label: (mean over runs of c(L), mean over runs of the bin's count or None)}, bins sorted."""
    vals: Dict[str, List[float]] = {}
    counts: Dict[str, List[float]] = {}
    for r in runs:
        for b, v in r.out_of_band_by_length().items():
            vals.setdefault(b, []).append(v)
            n = r.metrics.get(RUN_COUNT_PREFIX + b)
            if n is not None:
                counts.setdefault(b, []).append(float(n))
    out: Dict[str, Cell] = {}
    for b in sorted(vals):
        n = counts.get(b)
        # a run without the bin's count saw no sequence there only if it also lacks the value, so
        # the mean count is over the runs that logged one (runs predating the key: None)
        out[b] = (sum(vals[b]) / len(vals[b]), sum(n) / len(runs) if n else None)
    return out


def flatness(cells: Mapping[str, Cell], min_count: float = MIN_COUNT) -> Tuple[Optional[float], int]:
    """(max - min of c(L) over the populated bins, number of populated bins); (None, n) under 2 bins.
    A bin is populated when its mean count per run is >= ``min_count`` (or has no count logged)."""
    ys = [c for c, n in cells.values() if n is None or n >= min_count]
    return (max(ys) - min(ys) if len(ys) >= 2 else None), len(ys)


def sampling_se(cells: Mapping[str, Cell], n_runs: int, min_count: float = MIN_COUNT) -> Optional[float]:
    """Largest binomial standard error sqrt(c (1 - c) / N) over the populated bins, N = the bin's
    sequences over all ``n_runs`` runs: the noise floor of a max - min read off those bins (for a
    truly flat c, max - min over k bins is about 2-3 se for k ~ 10). None without counts."""
    se = [math.sqrt(c * (1 - c) / (n * n_runs)) for c, n in cells.values()
          if n is not None and n >= min_count and n > 0]
    return max(se) if se else None


def pooled_lre(runs: Sequence[RunRecord]) -> Tuple[Optional[float], Optional[float]]:
    """(LRE of the runs pooled, its sampling noise floor); (None, None) without per-bin counts.

    Bins as the run-level LRE: upper edge > the runs' ``diagnostics/lre_min_len`` param (0 if absent).
    Pooled: per bin, q_b = 1 - sum_r n_br c_br / n_b with n_b = sum_r n_br, then the paper's LRE
    = 0.5 sum_b (n_b / N) |q_b / q_bar - 1|, q_bar = sum_b n_b q_b / N (fspo/diagnostics/lre.py's
    formula on the summed counts: the acceptance curve the seeds estimate together). Noise floor:
    the LRE a perfectly flat curve (q_b = q_bar everywhere) shows in expectation with these counts,
    0.5 sum_b (n_b / N) sqrt(2 / pi) sqrt(q_bar (1 - q_bar) / n_b) / q_bar (each bin's binomial
    error, half-normal mean; the error of q_bar itself ignored). LRE is |.|-based, so noise only
    adds: a run-level LRE near its floor cannot be told from a flat curve.
    """
    n: Dict[str, float] = {}
    out: Dict[str, float] = {}
    for r in runs:
        min_len = float(r.params.get("diagnostics/lre_min_len", 0) or 0)
        for b, c in r.out_of_band_by_length().items():
            if label_edges(b)[1] <= min_len:  # as the run-level LRE: bins with upper edge > lre_min_len
                continue
            nb = r.metrics.get(RUN_COUNT_PREFIX + b)
            if nb is None:
                return None, None
            n[b] = n.get(b, 0.0) + nb
            out[b] = out.get(b, 0.0) + nb * c
    N = sum(n.values())
    if N <= 0:
        return None, None
    q = {b: 1.0 - out[b] / n[b] for b in n if n[b] > 0}
    qbar = sum(n[b] * q[b] for b in q) / N
    if qbar <= 0:
        return None, None
    lre = 0.5 * sum(n[b] * abs(q[b] / qbar - 1.0) for b in q) / N
    floor = 0.5 * sum(n[b] * math.sqrt(2 / math.pi) * math.sqrt(qbar * (1 - qbar) / n[b]) / qbar for b in q) / N
    return lre, floor


def by_length_rows(groups: Mapping[str, Sequence[RunRecord]], min_count: float = MIN_COUNT) -> List[dict]:
    """Per group: ``{"group", "n_runs", "cells": {bin: (c, n)}, "flatness", "n_populated", "max_se",
    "pooled_lre", "lre_floor"}``."""
    rows = []
    for g, runs in groups.items():
        cells = group_by_length(runs)
        flat, npop = flatness(cells, min_count)
        lre, floor = pooled_lre(runs)
        rows.append({"group": g, "n_runs": len(runs), "cells": cells, "flatness": flat, "n_populated": npop,
                     "max_se": sampling_se(cells, len(runs), min_count), "pooled_lre": lre, "lre_floor": floor})
    return rows


def _label(b: str) -> str:
    lo, hi = label_edges(b)
    return f"{lo:.0f}-{hi:.0f}" if math.isfinite(hi) else f"{lo:.0f}-inf"


def by_length_markdown(rows: Sequence[dict], min_count: float = MIN_COUNT) -> str:
    """Groups as rows, length bins as columns; each cell ``c(L)`` with its mean count per run below
    (``n=``); thin cells (count < ``min_count``) in parentheses; last column the flatness."""
    bins = sorted({b for r in rows for b in r["cells"]})
    head = (["Method", "n"] + [_label(b) for b in bins]
            + [f"max - min (bins with n >= {min_count:g}; largest se)", "pooled LRE (noise floor)"])
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * len(head)) + "|"]
    for r in rows:
        cells = []
        for b in bins:
            if b not in r["cells"]:
                cells.append("")
                continue
            c, n = r["cells"][b]
            txt = f"{c:.3f}<br>n={'?' if n is None else f'{n:.0f}'}"
            cells.append(txt if n is None or n >= min_count else f"({txt})")
        se = "" if r.get("max_se") is None else f"; se {r['max_se']:.3f}"
        flat = "-" if r["flatness"] is None else f"{r['flatness']:.3f} ({r['n_populated']} bins{se})"
        pl = "-" if r.get("pooled_lre") is None else f"{r['pooled_lre']:.4f} ({r['lre_floor']:.4f})"
        lines.append("| " + " | ".join([str(r["group"]), str(r["n_runs"])] + cells + [flat, pl]) + " |")
    return "\n".join(lines) + "\n"
