"""Read training runs back from MLflow for the report.

Owns: `RunRecord` (one job's tags, params, latest metrics and the histories the report needs) and
`load_runs` (search by experiment names and/or a filter string, drop sweep parents and report runs,
fetch histories). Leaves out: the numbers (table.py) and figures (figures.py).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

ROLE_TAG = "fspo.role"  # set on sweep parents and report runs (fspo/hydra_callbacks.py); jobs have none
BENCH_RE = re.compile(r"^(val/accuracy|eval/[^/]+/avg_at_(?:k|\d+))$")
CURVES = ("reward/mean", "rollout/response_len_mean", "rollout/overlong_rate", "val/accuracy")
RUN_CLIP_PREFIX = "run/clip/seq_frac/len_"
STEP_CLIP_PREFIX = "clip/seq_frac/len_"
History = List[Tuple[int, float]]


@dataclass
class RunRecord:
    """One training run: ``metrics`` are MLflow's latest values, ``history[key]`` is [(step, value)]
    sorted by step (ties by logging time, so the last entry is the final value)."""

    run_id: str
    name: str
    experiment_id: str
    status: str
    tags: Dict[str, str] = field(default_factory=dict)
    params: Dict[str, str] = field(default_factory=dict)
    metrics: Dict[str, float] = field(default_factory=dict)
    history: Dict[str, History] = field(default_factory=dict)

    def value(self, key: str, default: str = "?") -> str:
        """A tag, else a param (``clip/c_upper``), else ``default``: what runs are grouped by."""
        return self.tags.get(key, self.params.get(key, default))

    def group(self, keys: Sequence[str]) -> str:
        """Group label: the values of ``keys`` (``method``) or ``k=v`` joined by ``,`` for several keys."""
        if len(keys) == 1:
            return self.value(keys[0])
        return ",".join(f"{k}={self.value(k)}" for k in keys)

    def benchmarks(self) -> List[str]:
        """Validation metrics present: ``val/accuracy`` and ``eval/<benchmark>/avg_at_<k>``."""
        return sorted(k for k in self.metrics if BENCH_RE.match(k))

    def best(self, key: str) -> Optional[float]:
        """Max over the logged history of ``key`` (None if never logged)."""
        h = self.history.get(key)
        return max(v for _, v in h) if h else None

    def last(self, key: str) -> Optional[float]:
        """Value at the largest step (the last one logged there)."""
        h = self.history.get(key)
        return h[-1][1] if h else None

    def clip_by_length(self) -> Dict[str, float]:
        """Sequence clip fraction per length bin ``{len_XXXXX_YYYYY: frac}``: the run-level
        ``run/clip/seq_frac/len_*`` metrics, else the mean over steps of ``clip/seq_frac/len_*``
        (an unweighted mean of per-step fractions: an approximation when bin counts vary)."""
        run = {k[len("run/clip/seq_frac/"):]: v for k, v in self.metrics.items() if k.startswith(RUN_CLIP_PREFIX)}
        if run:
            return run
        out = {}
        for k, h in self.history.items():
            if k.startswith(STEP_CLIP_PREFIX) and h:
                out[k[len("clip/seq_frac/"):]] = sum(v for _, v in h) / len(h)
        return out


def _history(client, run_id: str, key: str) -> History:
    hist = client.get_metric_history(run_id, key)
    return [(int(m.step), float(m.value)) for m in sorted(hist, key=lambda m: (m.step, m.timestamp))]


def experiment_ids(client, names: Sequence[str]) -> List[str]:
    """Ids of the named experiments (ValueError naming the missing ones); all experiments if none named."""
    if not names:
        return [e.experiment_id for e in client.search_experiments()]
    ids, missing = [], []
    for n in names:
        e = client.get_experiment_by_name(n)
        (missing.append(n) if e is None else ids.append(e.experiment_id))
    if missing:
        have = sorted(e.name for e in client.search_experiments())
        raise ValueError(f"no MLflow experiment named {missing}; experiments at this tracking URI: {have}")
    return ids


def load_runs(client, experiments: Sequence[str] = (), filter_string: str = "",
              statuses: Sequence[str] = ("FINISHED",)) -> List[RunRecord]:
    """Training runs matching ``experiments`` (names) and ``filter_string`` (MLflow search syntax,
    e.g. ``tags.sweep = 'methods'``) with a status in ``statuses``; sweep parents and report runs
    (tag ``fspo.role``) are left out. Histories are fetched for the benchmarks, learning curves
    and, when a run has no run-level clip metrics, its per-step clip fractions by length.
    """
    from mlflow.entities import ViewType

    ids = experiment_ids(client, experiments)
    runs, token = [], None
    while True:
        page = client.search_runs(ids, filter_string=filter_string or "", run_view_type=ViewType.ACTIVE_ONLY,
                                  max_results=500, order_by=["attributes.start_time ASC"], page_token=token)
        runs.extend(page)
        token = page.token
        if not token:
            break
    out = []
    for r in runs:
        if r.data.tags.get(ROLE_TAG) or r.info.status not in statuses:
            continue
        rec = RunRecord(r.info.run_id, r.info.run_name or r.info.run_id, r.info.experiment_id, r.info.status,
                        dict(r.data.tags), dict(r.data.params), dict(r.data.metrics))
        keys = set(rec.benchmarks()) | {k for k in CURVES if k in rec.metrics}
        if not any(k.startswith(RUN_CLIP_PREFIX) for k in rec.metrics):
            keys |= {k for k in rec.metrics if k.startswith(STEP_CLIP_PREFIX)}
        rec.history = {k: _history(client, rec.run_id, k) for k in sorted(keys)}
        out.append(rec)
    return out
