"""The report's by-length view: out-of-band fraction c(L) = 1 - q(L) per length bin and group, the
sequences behind each cell, and how flat each group's curve is over its populated bins.

Owns: `by_length_rows` (per group and bin: c(L) as the mean over runs of each run's run-level
``run/band/out_frac/<bin>``, and the mean per run of ``run/band/n_seq/<bin>``, the sequences
counted for acceptance there), `flatness` (max - min of c(L) over the populated bins: a bin
counts when its mean count per run is >= ``min_count``; the issue's "flat within 0.05"), and the
Markdown table. Leaves out: reading MLflow (collect.py), figures (figures.py).

Why counts: a bin with 3 sequences shows 0.00 or 0.67 by chance; the LRE already weighs bins by
their counts, and a flatness read off thin bins says nothing. Runs logged before
``band/n_seq/<bin>`` existed have no counts: their bins are all treated as populated (and the
table says "n=?").
"""
from __future__ import annotations

import math
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from fspo.report.collect import RunRecord

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


def by_length_rows(groups: Mapping[str, Sequence[RunRecord]], min_count: float = MIN_COUNT) -> List[dict]:
    """Per group: ``{"group", "n_runs", "cells": {bin: (c, n)}, "flatness", "n_populated", "max_se"}``."""
    rows = []
    for g, runs in groups.items():
        cells = group_by_length(runs)
        flat, npop = flatness(cells, min_count)
        rows.append({"group": g, "n_runs": len(runs), "cells": cells, "flatness": flat, "n_populated": npop,
                     "max_se": sampling_se(cells, len(runs), min_count)})
    return rows


def _label(b: str) -> str:
    lo, hi = b[len("len_"):].split("_")
    return f"{int(lo)}-{hi if hi == 'inf' else int(hi)}"


def by_length_markdown(rows: Sequence[dict], min_count: float = MIN_COUNT) -> str:
    """Groups as rows, length bins as columns; each cell ``c(L)`` with its mean count per run below
    (``n=``); thin cells (count < ``min_count``) in parentheses; last column the flatness."""
    bins = sorted({b for r in rows for b in r["cells"]})
    head = ["Method", "n"] + [_label(b) for b in bins] + [f"max - min (bins with n >= {min_count:g}; largest se)"]
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
        lines.append("| " + " | ".join([str(r["group"]), str(r["n_runs"])] + cells + [flat]) + " |")
    return "\n".join(lines) + "\n"
