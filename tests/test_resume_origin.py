"""Resuming another run's checkpoint into a new output_dir (issue 33, item 11): a new MLflow run, tagged
with where it came from; the run that made the checkpoint is left untouched.

Owns: two real training runs on one MLflow SQLite store (run A writes a checkpoint; run B starts in another
folder with ``resume=<A's checkpoint>``), and the resume plan for a checkpoint inside / outside the
output folder. Leaves out: kill -9 and resume=auto in the same folder (test_resume.py).
"""
from __future__ import annotations

from pathlib import Path

from omegaconf import open_dict

from conftest import SMALL

BASE = [o for o in SMALL if not o.startswith("steps=")] + ["val.size=0", "checkpoint.every_n_steps=1"]


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
