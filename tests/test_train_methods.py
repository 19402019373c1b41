"""End to end: every method trains 2 RL steps through `fspo.train.train` (real Lightning Trainer,
HF engine, MLflow SQLite store) and the MLflow run holds what the design promises.

Each method runs in its own MLflow experiment of the session's shared store (conftest.py); the
test then reads the run back with `mlflow.MlflowClient`, independently of the code that wrote it.
"""
from __future__ import annotations

import re

import mlflow
import pytest

from conftest import SMALL

CLIP_TARGETS = {
    "fspo": "fspo.clipping.fspo.FSPOClip",
    "grpo": "fspo.clipping.grpo.GRPOClip",
    "rloo": "fspo.clipping.rloo.RLOOClip",
    "gspo": "fspo.clipping.gspo.GSPOClip",
    "vespo": "fspo.clipping.vespo.VESPOClip",
    "dppo": "fspo.clipping.dppo.DPPOClip",
    "cppo": "fspo.clipping.cppo.CPPOClip",
}
PER_STEP = ["clip/seq_frac", "fairness/lre", "reward/mean", "time/generate", "train/loss", "train/update_ratio"]
BIN_KEY = re.compile(r"^clip/seq_frac\.len_\d{5}_(\d{5}|inf)$")
SEED = 7


def _artifact_paths(client, run_id, path=None):
    out = []
    for a in client.list_artifacts(run_id, path):
        out.extend(_artifact_paths(client, run_id, a.path) if a.is_dir else [a.path])
    return out


# fspo validates after every step, the others only before training and at the end (the default
# every_n_steps=20 > steps=2); MLflow step s means "after s RL steps" for train and val metrics alike
VAL_EVERY = {"fspo": 1}
VAL_STEPS = {1: [0, 1, 2], 20: [0, 2]}


@pytest.mark.slow
@pytest.mark.parametrize("method", sorted(CLIP_TARGETS))
def test_two_steps_log_everything(method, compose_cfg, mlflow_uri, tmp_path):
    from fspo.train import train

    experiment = f"test_train_{method}"
    val_every = VAL_EVERY.get(method, 20)
    cfg = compose_cfg([f"+method={method}", "+model=tiny", *SMALL, f"seed={SEED}",
                       f"logger.experiment_name={experiment}", f"val.every_n_steps={val_every}"])
    final = train(cfg)
    assert 0.0 <= final["val/accuracy"] <= 1.0

    client = mlflow.MlflowClient(tracking_uri=mlflow_uri)
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, f"no MLflow experiment {experiment!r}"
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1
    run = runs[0]
    run_id = run.info.run_id
    assert run.info.status == "FINISHED"

    # params: the flattened, resolved config
    p = run.data.params
    assert p["method"] == method
    assert p["seed"] == str(SEED)
    assert p["clip/target"] == CLIP_TARGETS[method]
    assert p["ppo/mini_batch_size"] == "8"
    assert p["ppo/epochs"] == "1"
    assert p["ppo/target"] == "fspo.update.settings.PPOConfig"
    assert p["rollout/sampling/n"] == "4"
    assert p["steps"] == "2"
    assert p["model/source"] == "random"

    # tags
    t = run.data.tags
    assert (t["method"], t["model"], t["seed"]) == (method, "tiny", str(SEED))

    # per-step metrics: exactly one value at step 0 and one at step 1
    for key in PER_STEP:
        hist = client.get_metric_history(run_id, key)
        steps = sorted(m.step for m in hist)
        assert steps == [0, 1], f"{key}: logged at steps {steps}"
    bin_keys = [k for k in run.data.metrics if BIN_KEY.match(k)]
    assert bin_keys, f"no per-length clip fraction in {sorted(run.data.metrics)}"
    for key in bin_keys:
        assert sorted(m.step for m in client.get_metric_history(run_id, key)) == [0, 1], key
    # 16 sequences per step, mini-batches of 8 -> 2 optimizer updates per step
    assert [m.value for m in client.get_metric_history(run_id, "train/updates")] == [2.0, 2.0]
    assert 0.0 <= run.data.metrics["clip/seq_frac"] <= 1.0
    assert all(m.value > 0 for m in client.get_metric_history(run_id, "time/generate"))

    acc = client.get_metric_history(run_id, "val/accuracy")
    assert all(0.0 <= m.value <= 1.0 for m in acc)
    # one validation before training, then after every val_every steps, one value per step
    assert sorted(m.step for m in acc) == VAL_STEPS[val_every]

    # artifacts: figures and the resolved config
    paths = _artifact_paths(client, run_id)
    assert "config.yaml" in paths and "logratio_samples.csv" in paths, paths  # (L, S) sample: report Figure 1
    assert any(re.fullmatch(r"plots/[^/]+\.png", x) for x in paths), paths
    cfg_file = client.download_artifacts(run_id, "config.yaml", str(tmp_path))
    text = open(cfg_file).read()
    assert f"method: {method}" in text and CLIP_TARGETS[method] in text
