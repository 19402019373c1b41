"""An evaluation killed with ``kill -9`` does not leave its MLflow run RUNNING forever.

Owns: `end_orphans` (a RUNNING run whose tagged process on this host is gone is set KILLED with a reason; a live
process's run, another host's run and an untagged run are left alone) and the evaluation recorder tagging its
run with its process and ending the orphans of its experiment when it starts. Leaves out: training runs
(their resume continues them: test_resume.py).
"""
from __future__ import annotations

import subprocess
import sys
import time

import pytest
from mlflow import MlflowClient

from fspo.evaluation.summary import MlflowRecorder
from fspo.tracking.orphans import end_orphans, owner_tags


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.mark.slow  # > 2.5 s (a new MLflow store): out of the quick loop, still in CI
def test_a_killed_evaluation_s_run_is_ended_by_the_next_one(tmp_path):
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    c = MlflowClient(uri)
    exp = c.create_experiment("fspo-eval")
    mine = owner_tags()
    dead = {**mine, "fspo.pid": str(_dead_pid()), "fspo.started": f"{time.time() - 60:.0f}"}
    killed = c.create_run(exp, tags=dead).info.run_id
    alive = c.create_run(exp, tags={**mine, "fspo.pid": str(subprocess.os.getppid())}).info.run_id
    elsewhere = c.create_run(exp, tags={**dead, "fspo.host": "another-host"}).info.run_id
    untagged = c.create_run(exp).info.run_id
    rec = MlflowRecorder(uri, tmp_path / "out", experiment_name="fspo-eval")  # the next evaluation starts
    status = {r: c.get_run(r).info.status for r in (killed, alive, elsewhere, untagged)}
    assert status == {killed: "KILLED", alive: "RUNNING", elsewhere: "RUNNING", untagged: "RUNNING"}
    assert "was gone" in c.get_run(killed).data.tags["fspo.ended_by"]
    assert c.get_run(rec.run_id).data.tags["fspo.pid"] == mine["fspo.pid"]  # it can be found the same way
    assert end_orphans(c, exp) == []  # its own run is not an orphan
    rec.close(False, status="KILLED")  # a stop signal: KILLED, not FAILED
    assert c.get_run(rec.run_id).info.status == "KILLED"
