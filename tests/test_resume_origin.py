"""Resuming another run's checkpoint into a new output_dir: a new MLflow run, tagged
with where it came from; the run that made the checkpoint is left untouched.

Owns: two real training runs on one MLflow SQLite store (run A writes a checkpoint; run B starts in another
folder with ``resume=<A's checkpoint>``), and the resume plan for a checkpoint inside / outside the
output folder. Leaves out: kill -9 and resume=auto in the same folder (test_resume.py).
"""
from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import open_dict

from conftest import SMALL

BASE = [o for o in SMALL if not o.startswith("steps=")] + ["val.size=0", "checkpoint.every_n_steps=1"]


@pytest.mark.slow  # > 2.5 s: out of the quick loop (-m "not slow"), still in CI
def test_resume_into_a_new_output_dir_starts_its_own_tagged_run(compose_cfg, tmp_path):
    from mlflow.tracking import MlflowClient

    from fspo.train import train

    a = compose_cfg(BASE + ["steps=1"])
    train(a)
    a_out = Path(a.output_dir)
    a_id = (a_out / "mlflow_run_id").read_text().strip()
    client = MlflowClient(a.logger.tracking_uri)
    before = client.get_run(a_id)
    a_hist = [(m.step, m.value) for m in client.get_metric_history(a_id, "train/loss")]
    ckpt = sorted((a_out / "checkpoints").glob("step_*.ckpt"))[-1]

    b = compose_cfg(BASE + ["steps=2", f"resume={ckpt}"])
    with open_dict(b):
        b.output_dir = str(tmp_path / "b_out")
    train(b)
    b_id = (tmp_path / "b_out" / "mlflow_run_id").read_text().strip()
    assert b_id != a_id
    after = client.get_run(a_id)
    assert [(m.step, m.value) for m in client.get_metric_history(a_id, "train/loss")] == a_hist
    assert after.info.status == before.info.status and after.info.end_time == before.info.end_time
    assert not any(k.startswith("fspo.resume") for k in after.data.tags)
    tags = client.get_run(b_id).data.tags
    assert tags["fspo.resumed_from.run_id"] == a_id and tags["fspo.resumed_from.step"] == "1"
    assert tags["fspo.resumed_from.checkpoint"] == str(ckpt.resolve())
    assert [m.step for m in client.get_metric_history(b_id, "train/loss")] == [1]


def _history(client, rid, key="m"):
    return sorted((m.step, m.value) for m in client.get_metric_history(rid, key))


def test_overlap_resume_replaces_the_rerun_steps_values(compose_cfg, tmp_path):
    """With rollout.overlap the steps a resume re-runs log new values; they replace the
    killed attempt's (a synchronous resume keeps the first values: they are identical)."""
    from mlflow.tracking import MlflowClient

    from fspo.runtime.checkpoints.resume import ResumePlan
    from fspo.tracking.logger import build_logger

    for overlap, want in ((True, [(0, 0.0), (1, 1.0), (2, 20.0), (3, 30.0)]),
                          (False, [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0)])):
        cfg = compose_cfg(SMALL + [f"rollout.overlap.enable={str(overlap).lower()}", "ppo.old_log_probs=engine"])
        client = MlflowClient(cfg.logger.tracking_uri)
        exp = client.get_experiment_by_name(cfg.logger.experiment_name) or \
            client.get_experiment(client.create_experiment(cfg.logger.experiment_name))
        rid = client.create_run(exp.experiment_id).info.run_id
        for s in range(4):  # the killed attempt logged steps 0..3; its checkpoint is at step 2
            client.log_metric(rid, "m", float(s), step=s)
        logger = build_logger(cfg, {}, tmp_path, ResumePlan(ckpt_path="x", step=2, run_id=rid))[0]
        for s in (2, 3):
            logger.log_metrics({"m": 10.0 * s}, step=s)
        assert _history(client, rid) == want, overlap
        assert client.get_run(rid).data.metrics["m"] == want[-1][1]
