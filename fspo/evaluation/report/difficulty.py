"""The paper's Figure 4 from an evaluate run: per problem, ordered by difficulty, the overlong rate and the mean
length excluding overlong samples. Per problem p with k_p samples, n_p overlong (length exactly M =
max_new_tokens), mean length lbar_p:

    rank: accuracy, easiest first (ties by id)    o_p = n_p / k_p    len_excl = (k_p lbar_p - n_p M) / (k_p - n_p)

(NaN when n_p = k_p).
"""
from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from matplotlib.figure import Figure

Table = Dict[str, list]


def difficulty_rows(table: Table, max_new_tokens: float) -> List[Dict[str, float]]:
    """Rows (``rank``, ``problem_id``, ``accuracy``, ``overlong_rate``, ``mean_len_excl_overlong``, ``k``), easiest
    first, from a per-problem table."""
    need = ("problem_id", "k", "n_correct", "mean_response_len", "n_overlong")
    missing = [c for c in need if c not in table]
    if missing:
        raise ValueError(f"per-problem table lacks columns {missing}: "
                         f"expected experiments/evaluate.py's per_problem.json")
    rows = []
    for pid, k, c, mean_len, n_over in zip(*(table[c] for c in need)):
        k, n_over = int(k), int(n_over)
        kept = k - n_over
        excl = (k * float(mean_len) - n_over * float(max_new_tokens)) / kept if kept > 0 else math.nan
        rows.append({"problem_id": str(pid), "k": k, "accuracy": int(c) / max(k, 1),
                     "overlong_rate": n_over / max(k, 1), "mean_len_excl_overlong": excl})
    rows.sort(key=lambda r: (-r["accuracy"], r["problem_id"]))
    for i, r in enumerate(rows):
        r["rank"] = i
    return rows


def eval_tables(client, run_id: str) -> Dict[str, Tuple[Table, float]]:
    """``{"<benchmark>[ step N]": (per-problem table, max_new_tokens)}`` of evaluate run ``run_id``; ValueError when it
    holds no per_problem.json."""
    from mlflow.artifacts import download_artifacts

    found: List[str] = []

    def walk(path: Optional[str]) -> None:
        for a in client.list_artifacts(run_id, path):
            if a.is_dir:
                walk(a.path)
            elif a.path.endswith("/per_problem.json"):
                found.append(a.path)

    walk("eval")
    if not found:
        raise ValueError(f"run {run_id} has no eval/<benchmark>/per_problem.json: give the id of an "
                         f"experiments/evaluate.py run (its MLflow run, tag eval/checkpoint)")
    out: Dict[str, Tuple[Table, float]] = {}
    for path in sorted(found):
        parts = path.split("/")  # eval/<benchmark>[/step_N]/per_problem.json
        bench, step = parts[1], (parts[2][len("step_"):] if len(parts) == 4 else None)
        with tempfile.TemporaryDirectory() as tmp:
            local = Path(download_artifacts(run_id=run_id, artifact_path=path, dst_path=tmp,
                                            tracking_uri=client.tracking_uri))
            doc = json.loads(local.read_text())
        table = {c: [row[i] for row in doc["data"]] for i, c in enumerate(doc["columns"])}
        hist = client.get_metric_history(run_id, f"eval/{bench}/max_new_tokens")
        at = [m.value for m in hist if step is None or m.step == int(step)] or [m.value for m in hist]
        if not at:
            raise ValueError(f"run {run_id} has no eval/{bench}/max_new_tokens metric: cannot tell overlong "
                             f"samples' length")
        out[bench if step is None else f"{bench} step {step}"] = (table, float(at[-1]))
    return out


def difficulty_figure(rows_by_name: Mapping[str, Sequence[Mapping[str, float]]]) -> Figure:
    """Figure 4: per benchmark, overlong rate (top) and length excluding overlong (bottom) by rank."""
    n = max(len(rows_by_name), 1)
    fig = Figure(figsize=(4.2 * n, 6.0), layout="constrained")
    axes = fig.subplots(2, n, squeeze=False, sharex="col")
    for j, (name, rows) in enumerate(rows_by_name.items()):
        x, top, bottom = [r["rank"] for r in rows], axes[0][j], axes[1][j]
        top.bar(x, [r["overlong_rate"] for r in rows], width=1.0, color="tab:red")
        top.set(title=name, ylabel="overlong rate", ylim=(0, 1))
        bottom.plot(x, [r["mean_len_excl_overlong"] for r in rows], ".", color="tab:blue")
        bottom.set(ylabel="mean length, overlong excluded", xlabel="problem, easiest -> hardest (by accuracy)")
    fig.suptitle("Per-problem overlong rate and length by difficulty")
    return fig


def write_difficulty(tracking_uri: str, run_ids: Sequence[str], out: Path) -> Path:
    """``out/difficulty.csv`` and ``out/figures/difficulty.png`` for ``run_ids``; returns the figure's path."""
    import csv

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    rows_by_name: Dict[str, List[Dict[str, float]]] = {}
    for rid in run_ids:
        for name, (table, max_new) in eval_tables(client, rid).items():
            label = name if len(run_ids) == 1 else f"{name} ({rid[:8]})"
            rows_by_name[label] = difficulty_rows(table, max_new)
    out = Path(out)
    (out / "figures").mkdir(parents=True, exist_ok=True)
    with open(out / "difficulty.csv", "w", newline="") as f:
        cols = ["benchmark", "rank", "problem_id", "k", "accuracy", "overlong_rate", "mean_len_excl_overlong"]
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        for name, rows in rows_by_name.items():
            for r in rows:
                w.writerow({"benchmark": name, **{c: r[c] for c in cols[1:]}})
    path = out / "figures" / "difficulty.png"
    difficulty_figure(rows_by_name).savefig(path)
    return path
