"""The report's by-length view: c(L) = 1 - q(L) per length bin and group (mean over runs of
``run/band/out_frac/<bin>``), the sequences per run behind each cell (``run/band/n_seq/<bin>``), and the
flatness (max - min over bins whose mean count per run is >= ``min_count``; target: within 0.05). A thin bin
shows 0.00 or 0.67 by chance, so it does not count; older runs without counts count every bin ("n=?").
"""
from __future__ import annotations

import math
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from fspo.diagnostics.bins import label_edges
from fspo.evaluation.report.collect import RunRecord

MIN_COUNT = 100  # sequences per run
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
    """(max - min of c(L) over the populated bins, their number); (None, n) under 2 bins."""
    ys = [c for c, n in cells.values() if n is None or n >= min_count]
    return (max(ys) - min(ys) if len(ys) >= 2 else None), len(ys)


def sampling_se(cells: Mapping[str, Cell], n_runs: int, min_count: float = MIN_COUNT) -> Optional[float]:
    """Largest binomial standard error sqrt(c (1 - c) / N) over the populated bins (N over all ``n_runs`` runs): the
    noise floor of a max - min. None without counts."""
    se = [math.sqrt(c * (1 - c) / (n * n_runs)) for c, n in cells.values()
          if n is not None and n >= min_count and n > 0]
    return max(se) if se else None


def pooled_lre(runs: Sequence[RunRecord]) -> Tuple[Optional[float], Optional[float]]:
    """(LRE of the runs pooled, its noise floor); (None, None) without counts. Bins as the run-level LRE (upper edge
    > ``diagnostics/lre_min_len``); q_b = 1 - sum_r n_br c_br / n_b, then lre.py's formula. Floor: the expected
    LRE of a flat curve at these counts, 0.5 sum_b (n_b / N) sqrt(2 / pi) sqrt(q_bar (1 - q_bar) / n_b) / q_bar."""
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
    """Per group: ``{"group", "n_runs", "cells": {bin: (c, n)}, "flatness", "n_populated", "max_se", "pooled_lre",
    "lre_floor"}``."""
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
    """Groups as rows, bins as columns; cells ``c(L)`` with ``n=`` (mean count per run) below, thin ones in
    parentheses; last column the flatness."""
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
