"""What a training run and its MLflow experiment are called and say about themselves.

MLflow's random run names come from Python's global ``random``, which ``seed_everything`` has seeded, so every
launch with the same seed got the same name: the default name says what ran and when instead.
"""
from __future__ import annotations

import logging
import time
from typing import Optional

log = logging.getLogger(__name__)
NOTE_TAG = "mlflow.note.content"
KIND_TAG, KIND = "mlflow.experimentKind", "custom_model_development"  # MLflow 3.x: a training experiment

EXPERIMENT_NOTE = """\
FSPO training runs (length-fair sequence-level RL for LLMs): one run per `python experiments/run.py`
launch; the run name is `<method>-<model>-s<seed>-<MMDD>-<HHMMSS>` unless `run_name=` is set.

- **Params**: the resolved config, flattened (`clip/c_upper`, `ppo/lr`, `prompts_per_step`, ...);
  settings that do not change during a run are params, not metrics.
- **Metrics**: the run page's first chart section, `Headline`, holds copies of what to look at first:
  held-out accuracy, LRE, the out-of-band fraction overall and per length bin. Then one section per
  family: `val/` held-out accuracy, `train/` loss, KL and grad norm,
  `reward/`, `rollout/` lengths, `clip/` binding clip fractions (per length bin:
  `clip/seq_frac.len_<lo>_<hi>`), `band/` the paper's out-of-band fraction c(L), `fairness/` the LRE,
  `logratio/` statistics of the sequence log-ratio, `perf/` and `time/` costs, `run/` whole-run aggregates
  logged once at the end; last, `zz counts`: how many sequences each fraction is over (per length bin).
- **Runs table**: add columns from "Columns" (e.g. `val/accuracy`, `fairness/lre`, `run/fairness.lre`).
- **Artifacts**: `config.yaml` and `plots/` (clip fraction by length, LRE by step, Q-Q, std vs sqrt(L)).

Compare runs with `python experiments/report.py` (tables and figures across methods and seeds).
"""


def default_run_name(method: str, model: str, seed, now: Optional[float] = None) -> str:
    """``fspo-tiny-s42-1123-141205`` for method fspo, model tiny, seed 42 at 14:12:05 on 23 Nov (local time)."""
    return f"{method}-{model}-s{seed}-{time.strftime('%m%d-%H%M%S', time.localtime(now))}"


def describe_experiment(tracking_uri: Optional[str], experiment_name: Optional[str],
                        note: str = EXPERIMENT_NOTE) -> bool:
    """Set the description of an existing experiment unless it has one; True if set. Also tag its kind
    (``mlflow.experimentKind``) when it has none: MLflow's UI picks its default view from it."""
    from mlflow.tracking import MlflowClient

    if not experiment_name:
        return False
    client = MlflowClient(tracking_uri=tracking_uri)
    exp = client.get_experiment_by_name(experiment_name)
    if exp is None:
        return False
    if not exp.tags.get(KIND_TAG):
        client.set_experiment_tag(exp.experiment_id, KIND_TAG, KIND)
    if exp.tags.get(NOTE_TAG):
        return False
    client.set_experiment_tag(exp.experiment_id, NOTE_TAG, note)
    return True
