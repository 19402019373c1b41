"""The length law's targets on a sweep's runs, one row per group (means over its runs; None where no run logged
a value or a ratio's denominator is 0): ``std_exponent``, ``std_exponent_r2``, ``qq_r2``, ``qq_r2_per_bin``;
``bins_lo`` / ``bins_hi`` / ``span`` of the bins with >= ``min_count`` sequences counted for acceptance;
``oob_first`` / ``oob_last`` / ``oob_max_min`` of c(L) over them (flat: <= 1.5; RLOO rising: last / first >= 3;
GSPO falling: first / last >= 3); ``lre``; ``acf_1``, ``acf_tau``.
"""
from __future__ import annotations

from statistics import mean
from typing import Dict, List, Optional, Sequence

from fspo.diagnostics.bins import label_edges
from fspo.evaluation.report.collect import RunRecord
from fspo.evaluation.report.table import md_table

COUNT_PREFIX = "run/band/n_seq/"
OOB_PREFIX = "run/band/out_frac/"
SCALARS = (("std_exponent", "run/logratio/std_exponent"), ("std_exponent_r2", "run/logratio/std_exponent_r2"),
           ("qq_r2", "run/logratio/qq_r2"), ("qq_r2_per_bin", "run/logratio/qq_r2_per_bin"),
           ("lre", "run/fairness/lre"), ("sigma_hat", "run/logratio/sigma_hat"),
           ("acf_1", "run/logratio/acf/lag_0001"), ("acf_tau", "run/logratio/acf_tau"))


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or b is None or b == 0 else a / b


def _avg(xs) -> Optional[float]:
    xs = [x for x in xs if x is not None]
    return mean(xs) if xs else None


def run_shape(rec: RunRecord, min_count: float) -> Dict[str, Optional[float]]:
    """One run's bins with >= ``min_count`` sequences: span and the out-of-band fraction's shape."""
    bins = []
    for k, n in rec.metrics.items():
        if k.startswith(COUNT_PREFIX) and n >= min_count:
            label = k[len(COUNT_PREFIX):]
            c = rec.metrics.get(OOB_PREFIX + label)
            if c is not None:
                lo, hi = label_edges(label)
                bins.append((lo, hi, c))
    bins.sort()
    if not bins:
        return dict.fromkeys(("bins_lo", "bins_hi", "span", "oob_first", "oob_last", "oob_max_min"))
    lo, hi = bins[0][0], bins[-1][1]
    cs = [c for _, _, c in bins]
    return {"bins_lo": lo, "bins_hi": hi, "span": _ratio(hi, max(lo, 1)), "oob_first": cs[0], "oob_last": cs[-1],
            "oob_max_min": _ratio(max(cs), min(cs))}


def law_rows(groups: Dict[str, List[RunRecord]], min_count: float = 20) -> List[Dict[str, object]]:
    """One row per group: ``group``, ``n_runs`` and the module docstring's columns (means over its runs)."""
    rows = []
    for name, runs in groups.items():
        row: Dict[str, object] = {"group": name, "n_runs": len(runs)}
        for col, key in SCALARS:
            row[col] = _avg(r.metrics.get(key) for r in runs)
        shapes = [run_shape(r, min_count) for r in runs]
        for col in ("bins_lo", "bins_hi", "span", "oob_first", "oob_last", "oob_max_min"):
            row[col] = _avg(s[col] for s in shapes)
        rows.append(row)
    return rows


def _f(x, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def law_markdown(rows: Sequence[Dict[str, object]]) -> str:
    """The rows as a markdown table (the targets in the header)."""
    cols = [("group", "Method"), ("n_runs", "n"), ("std_exponent", "std exponent [0.4,0.6]"),
            ("std_exponent_r2", "fit R2"), ("qq_r2", "Q-Q R2 (>= 0.97)"), ("qq_r2_per_bin", "Q-Q R2 per bin"),
            ("bins_lo", "bins from"), ("bins_hi", "bins to"), ("oob_first", "c(L) first"), ("oob_last", "c(L) last"),
            ("oob_max_min", "c(L) max/min"), ("lre", "LRE"), ("sigma_hat", "sigma_hat"), ("acf_1", "acf lag 1"),
            ("acf_tau", "acf tau")]
    return md_table([h for _, h in cols],
                    [[_f(r.get(c), 0 if c in ("bins_lo", "bins_hi") else 3) for c, _ in cols] for r in rows])
