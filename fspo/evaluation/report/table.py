"""The report's numbers: the paper's Table 1 (per group and benchmark, best and last of each run's history
averaged over the group's runs; "average" over benchmarks, as the paper's Average column), the fairness
summary (run-level diagnostics, mean over runs), one row per run, and CSV / Markdown writers.
"""
from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from fspo.evaluation.report.collect import RunRecord

ORDER = ("base", "grpo", "rloo", "rloo_wide", "gspo", "fspo")  # the paper's row order
FAIRNESS = (("lre", "run/fairness/lre"), ("lre_w", "run/fairness/lre_w"), ("q_bar", "run/fairness/q_bar"),
            ("out_of_band_frac", "run/band/out_frac"), ("binding_lre", "run/fairness/binding_lre"),
            ("binding_q_bar", "run/fairness/binding_q_bar"),
            ("seq_clip_frac", "run/clip/seq_frac"), ("sigma_hat", "run/logratio/sigma_hat"),
            ("qq_slope", "run/logratio/qq_slope"), ("qq_r2", "run/logratio/qq_r2"),
            ("std_exponent", "run/logratio/std_exponent"), ("std_exponent_r2", "run/logratio/std_exponent_r2"),
            ("overlong_rate", "run/rollout/overlong_rate"), ("response_len_mean", "run/rollout/response_len_mean"),
            # measured gradients (diagnostics.grad_probe_every): the last probed step's
            ("lre_w_grad", "probe/lre_w"), ("probe_cos", "probe/cos"), ("partition_lre", "probe/partition_lre"))
Row = Dict[str, object]


def _order(name: str) -> Tuple[int, str]:
    head = name.split(",")[0].split("=")[-1]
    return (ORDER.index(head) if head in ORDER else len(ORDER), name)


def group_runs(records: Sequence[RunRecord], keys: Sequence[str] = ("method",)) -> Dict[str, List[RunRecord]]:
    """{group label: runs}, in the paper's method order (then alphabetical), runs by seed."""
    groups: Dict[str, List[RunRecord]] = {}
    for r in records:
        groups.setdefault(r.group(keys), []).append(r)
    for runs in groups.values():
        runs.sort(key=lambda r: (r.value("seed"), r.run_id))
    return {g: groups[g] for g in sorted(groups, key=_order)}


def mean_std(values: Sequence[Optional[float]]) -> Tuple[Optional[float], Optional[float], int]:
    """(mean, sample std (ddof=1; None for fewer than 2), n) over the non-None values."""
    v = [float(x) for x in values if x is not None and math.isfinite(float(x))]
    if not v:
        return None, None, 0
    m = sum(v) / len(v)
    s = math.sqrt(sum((x - m) ** 2 for x in v) / (len(v) - 1)) if len(v) > 1 else None
    return m, s, len(v)


def benchmarks(records: Sequence[RunRecord]) -> List[str]:
    """Benchmarks logged by any run: ``val/accuracy`` first, then ``eval/*`` sorted."""
    keys = sorted({b for r in records for b in r.benchmarks()})
    return sorted(keys, key=lambda k: (k != "val/accuracy", k))


def table1(groups: Dict[str, List[RunRecord]]) -> Tuple[List[str], List[Row]]:
    """(benchmarks, rows): per group ``<bench> best|last`` (mean over runs), their ``std``, ``n``, and ``average
    best|last`` with >= 2 benchmarks; first a ``base`` row, the mean of each benchmark's step-0 value."""
    every = [r for runs in groups.values() for r in runs]
    benches = benchmarks(every)
    rows: List[Row] = []
    base: Row = {"group": "base", "n_runs": 0, "seeds": ""}
    for b in benches:  # the paper's "base" row: the validation before the first update (step 0)
        m, s, n = mean_std([r.history[b][0][1] for r in every if r.history.get(b) and r.history[b][0][0] == 0])
        base.update({f"{b} best": m, f"{b} last": m, f"{b} best std": s, f"{b} last std": s, f"{b} n": n})
        base["n_runs"] = max(int(base["n_runs"]), n)
    if base["n_runs"]:
        rows.append(base)
    for g, runs in groups.items():
        row: Row = {"group": g, "n_runs": len(runs), "seeds": " ".join(r.value("seed") for r in runs)}
        for b in benches:
            for kind, fn in (("best", RunRecord.best), ("last", RunRecord.last)):
                m, s, n = mean_std([fn(r, b) for r in runs])
                row[f"{b} {kind}"], row[f"{b} {kind} std"], row[f"{b} n"] = m, s, n
        rows.append(row)
    for row in rows if len(benches) >= 2 else ():
        for kind in ("best", "last"):
            vals = [row[f"{b} {kind}"] for b in benches]
            row[f"average {kind}"] = None if any(v is None for v in vals) else sum(vals) / len(vals)
    return benches, rows


def fairness_rows(groups: Dict[str, List[RunRecord]]) -> List[Row]:
    """Per group: mean and std over runs of `FAIRNESS`, and the final ``reward/mean``."""
    rows = []
    for g, runs in groups.items():
        row: Row = {"group": g, "n_runs": len(runs)}
        for name, key in FAIRNESS:
            m, s, _ = mean_std([r.metrics.get(key) for r in runs])
            row[name], row[f"{name} std"] = m, s
        row["reward last"] = mean_std([r.last("reward/mean") for r in runs])[0]
        rows.append(row)
    return rows


def run_rows(records: Sequence[RunRecord], keys: Sequence[str] = ("method",)) -> List[Row]:
    """One row per run: ids, group, seed, best/last per benchmark and the run-level diagnostics."""
    benches = benchmarks(records)
    rows = []
    for r in records:
        row: Row = {"run_id": r.run_id, "run_name": r.name, "experiment_id": r.experiment_id,
                    "group": r.group(keys), "method": r.value("method"), "seed": r.value("seed"),
                    "model": r.value("model")}
        for b in benches:
            row[f"{b} best"], row[f"{b} last"] = r.best(b), r.last(b)
        for name, key in FAIRNESS:
            row[name] = r.metrics.get(key)
        rows.append(row)
    return rows


def write_csv(rows: Sequence[Row], path: Path) -> Path:
    """Rows as CSV: the union of keys in first-seen order, None empty, floats to 4 significant digits."""
    cols: List[str] = []
    for row in rows:
        cols += [k for k in row if k not in cols]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        for row in rows:
            w.writerow({k: _cell(row.get(k)) for k in cols})
    return Path(path)


def _cell(v) -> str:
    if v is None:
        return ""
    return f"{v:.4g}" if isinstance(v, float) else v


def _f(v, digits: int = 4) -> str:
    return "-" if v is None else f"{float(v):.{digits}f}"


def md_table(header: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] * len(header)) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in body]) + "\n"


def table1_markdown(benches: Sequence[str], rows: Sequence[Row]) -> str:
    """The paper's Table 1 layout: cells ``best/last``; the ``base`` row its step-0 value."""
    avg = any("average best" in r for r in rows)
    header = ["Method", "n"] + [f"{b} (Best/Last)" for b in benches] + (["Average (Best/Last)"] if avg else [])
    body = []
    for r in rows:
        cells = [str(r["group"]), str(r["n_runs"])]
        pair = (lambda a, b: _f(a)) if r["group"] == "base" else (lambda a, b: f"{_f(a)}/{_f(b)}")
        cells += [pair(r.get(f"{b} best"), r.get(f"{b} last")) for b in benches]
        if avg:
            cells.append(pair(r.get("average best"), r.get("average last")))
        body.append(cells)
    return md_table(header, body)


def fairness_markdown(rows: Sequence[Row]) -> str:
    """The fairness summary as a Markdown table (LRE with +- std over runs)."""
    header = ["Method", "n", "LRE", "LRE_w", "out-of-band frac", "binding LRE", "binding clip frac", "sigma_hat",
              "Q-Q slope", "Q-Q R2", "std exponent", "exponent R2", "overlong rate", "mean len", "reward (last)",
              "LRE_w (measured g_L)", "cos(g^b, g*)", "group-reward LRE"]
    body = []
    for r in rows:
        pm = "" if r.get("lre std") is None else f" +- {_f(r['lre std'])}"
        body.append([str(r["group"]), str(r["n_runs"]), _f(r.get("lre")) + pm, _f(r.get("lre_w")),
                     _f(r.get("out_of_band_frac")), _f(r.get("binding_lre")),
                     _f(r.get("seq_clip_frac")), _f(r.get("sigma_hat")), _f(r.get("qq_slope"), 3),
                     _f(r.get("qq_r2"), 3), _f(r.get("std_exponent"), 3), _f(r.get("std_exponent_r2"), 3),
                     _f(r.get("overlong_rate"), 3), _f(r.get("response_len_mean"), 1),
                     _f(r.get("reward last")), _f(r.get("lre_w_grad")), _f(r.get("probe_cos"), 3),
                     _f(r.get("partition_lre"))])
    return md_table(header, body)


def _pm(m, s, digits: int = 4) -> str:
    return _f(m, digits) + ("" if s is None else f" +- {_f(s, digits)}")


def seeds_markdown(t1_rows: Sequence[Row], fair_rows: Sequence[Row], bench: str = "val/accuracy") -> str:
    """Mean +- sample std over each group's runs of LRE, out-of-band fraction and ``bench`` best and last."""
    acc = {r["group"]: r for r in t1_rows}
    header = ["Method", "n", "seeds", "LRE", "out-of-band frac", f"{bench} best", f"{bench} last"]
    body = []
    for r in fair_rows:
        a = acc.get(r["group"], {})
        body.append([str(r["group"]), str(r["n_runs"]), str(a.get("seeds", "")), _pm(r.get("lre"), r.get("lre std")),
                     _pm(r.get("out_of_band_frac"), r.get("out_of_band_frac std"), 3),
                     _pm(a.get(f"{bench} best"), a.get(f"{bench} best std"), 3),
                     _pm(a.get(f"{bench} last"), a.get(f"{bench} last std"), 3)])
    return md_table(header, body)
