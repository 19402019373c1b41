"""Read training runs back from MLflow for the report (sweep parents and report runs left out)."""
from __future__ import annotations

import logging
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from fspo.diagnostics.metric_keys import canonical_key
from fspo.evaluation.best_last import best_last

ROLE_TAG = "fspo.role"  # set on sweep parents and report runs; jobs have none
BENCH_RE = re.compile(r"^(val/accuracy|eval/[^/]+/avg_at_(?:k|\d+))$")
CURVES = ("reward/mean", "rollout/response_len_mean", "rollout/overlong_rate", "val/accuracy")
RUN_CLIP_PREFIX = "run/clip/seq_frac/len_"  # binding-clip fraction by length (what the optimizer sees)
STEP_CLIP_PREFIX = "clip/seq_frac/len_"
RUN_BAND_PREFIX = "run/band/out_frac/len_"  # out-of-band fraction by length: the paper's c(L) = 1 - q(L)
STEP_BAND_PREFIX = "band/out_frac/len_"
BY_LENGTH = ((RUN_CLIP_PREFIX, STEP_CLIP_PREFIX), (RUN_BAND_PREFIX, STEP_BAND_PREFIX))
History = List[Tuple[int, float]]
log = logging.getLogger(__name__)


@dataclass
class RunRecord:
    """One training run: ``metrics`` MLflow's latest values, ``history[key]`` [(step, value)] by step (ties by
    logging time)."""

    run_id: str
    name: str
    experiment_id: str
    status: str
    tags: Dict[str, str] = field(default_factory=dict)
    params: Dict[str, str] = field(default_factory=dict)
    metrics: Dict[str, float] = field(default_factory=dict)
    history: Dict[str, History] = field(default_factory=dict)

    def value(self, key: str, default: str = "?") -> str:
        """A tag, else a param, else ``default``: what runs are grouped by."""
        return self.tags.get(key, self.params.get(key, default))

    def group(self, keys: Sequence[str]) -> str:
        """Group label: the value of one key, or ``k=v`` joined by ``,``."""
        if len(keys) == 1:
            return self.value(keys[0])
        return ",".join(f"{k}={self.value(k)}" for k in keys)

    def benchmarks(self) -> List[str]:
        """Validation metrics present: ``val/accuracy`` and ``eval/<benchmark>/avg_at_<k>``."""
        return sorted(k for k in self.metrics if BENCH_RE.match(k))

    def best(self, key: str) -> Optional[float]:
        """The best value of ``key``'s history (`best_last`); None if never logged."""
        h = self.history.get(key)
        return h[best_last([v for _, v in h])[0]][1] if h else None

    def last(self, key: str) -> Optional[float]:
        """The value at the largest step (`best_last`)."""
        h = self.history.get(key)
        return h[best_last([v for _, v in h])[1]][1] if h else None

    def _by_length(self, run_prefix: str, step_prefix: str) -> Dict[str, float]:
        """``{len_XXXXX_YYYYY: value}`` from the run-level ``<run_prefix>*`` metrics, else the unweighted mean
        over steps of ``<step_prefix>*``."""
        cut = len(run_prefix) - len("len_")
        run = {k[cut:]: v for k, v in self.metrics.items() if k.startswith(run_prefix)}
        if run:
            return run
        cut = len(step_prefix) - len("len_")
        return {k[cut:]: sum(v for _, v in h) / len(h) for k, h in self.history.items()
                if k.startswith(step_prefix) and h}

    def clip_by_length(self) -> Dict[str, float]:
        """Sequence binding-clip fraction per length bin."""
        return self._by_length(RUN_CLIP_PREFIX, STEP_CLIP_PREFIX)

    def out_of_band_by_length(self) -> Dict[str, float]:
        """Out-of-band fraction c(L) = 1 - q(L) per length bin (empty for older runs)."""
        return self._by_length(RUN_BAND_PREFIX, STEP_BAND_PREFIX)


def _history(client, run_id: str, key: str) -> History:
    hist = client.get_metric_history(run_id, key)
    return [(int(m.step), float(m.value)) for m in sorted(hist, key=lambda m: (m.step, m.timestamp))]


def experiment_ids(client, names: Sequence[str]) -> List[str]:
    """Ids of the named experiments (ValueError naming the missing ones); all when none named."""
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
    """Training runs in ``experiments`` matching ``filter_string`` (MLflow search syntax) with a status in
    ``statuses``, with the histories of the benchmarks, learning curves and, without run-level by-length
    metrics, the per-step ones."""
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
        stored = {canonical_key(k): k for k in r.data.metrics}  # our names -> MLflow keys
        rec = RunRecord(r.info.run_id, r.info.run_name or r.info.run_id, r.info.experiment_id, r.info.status,
                        dict(r.data.tags), dict(r.data.params), {k: r.data.metrics[s] for k, s in stored.items()})
        keys = set(rec.benchmarks()) | {k for k in CURVES if k in rec.metrics}
        for run_prefix, step_prefix in BY_LENGTH:
            if not any(k.startswith(run_prefix) for k in rec.metrics):
                keys |= {k for k in rec.metrics if k.startswith(step_prefix)}
        rec.history = {k: _history(client, rec.run_id, stored.get(k, k)) for k in sorted(keys)}
        out.append(rec)
    return out


def read_artifact(tracking_uri: str, run: RunRecord, path: str, read: Callable[[Path], Any],
                  dst: Optional[Path] = None) -> Any:
    """``read`` of ``run``'s artifact ``path``, downloaded to ``dst`` (None: a temporary folder); None, with a
    warning, when the run has none (a run without it must not sink the report)."""
    from mlflow.artifacts import download_artifacts

    try:
        with tempfile.TemporaryDirectory() as tmp:
            return read(Path(download_artifacts(run_id=run.run_id, artifact_path=path, dst_path=str(dst or tmp),
                                                tracking_uri=tracking_uri)))
    except Exception as e:  # noqa: BLE001
        log.warning("run %s has no %s (%s)", run.run_id, path, type(e).__name__)
        return None
