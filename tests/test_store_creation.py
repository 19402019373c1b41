"""Nothing bricked at start-up: store creation, two sweeps at once, default folders.

Owns: a SIGINT at spread-out moments of a fresh SQLite store's creation (each time the next open succeeds
and the store is complete, at MLflow's head revision), a half-created store (no runs: moved aside and
created again; with runs: one line, untouched), two sweeps started together on one fresh store (both
exit 0, each under its own parent run, in their own default sweep folders), and default run folders
(two launches in the same second get two folders; the ranks of one torchrun launch share one).
Leaves out: the other storage checks (test_store_check.py) and the sweep configs (test_sweeps.py).
"""
from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, SMALL

CREATE = """
import sys, time
from fspo.runtime.checks.store_check import prepare_store
print("go", flush=True)
t0 = time.monotonic()
prepare_store(sys.argv[1], "exp")
print(f"took {time.monotonic() - t0:.3f}", flush=True)
"""


def _env():
    return {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}


def _start_create(db: Path) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", CREATE, f"sqlite:///{db}"], cwd=db.parent, env=_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert p.stdout.readline().strip() == "go"  # imports done: the clock starts at prepare_store
    return p


def _complete(db: Path) -> bool:
    from fspo.runtime.checks.sqlite_store import _head_revision, store_state

    s = store_state(db)
    return s["version"] == _head_revision() and not s["tmp_tables"]


@pytest.mark.slow
def test_sigint_at_any_moment_of_store_creation_leaves_a_usable_store(tmp_path):
    from fspo.runtime.checks.store_check import prepare_store

    probe = _start_create(tmp_path / "probe.db")  # how long creation takes on this machine, now
    took = float(probe.stdout.readline().split()[1])
    probe.wait(60)
    for i, frac in enumerate((0.05, 0.25, 0.45, 0.65, 0.85)):
        d = tmp_path / f"s{i}"
        d.mkdir()
        db = d / "m.db"
        p = _start_create(db)
        time.sleep(frac * took)
        p.send_signal(signal.SIGINT)
        p.wait(60)
        assert not db.exists() or _complete(db), f"SIGINT at {frac:.0%} of {took:.2f} s left a broken store"
        prepare_store(f"sqlite:///{db}", "exp")  # the next run opens it
        assert _complete(db)
        assert not list(d.glob(".m.db.creating-*"))


def _half_created(db: Path, runs: bool) -> None:
    from fspo.runtime.checks.store_check import prepare_store

    prepare_store(f"sqlite:///{db}", "exp" if runs else None)
    with sqlite3.connect(db) as con:
        if runs:
            con.execute("INSERT INTO runs (run_uuid, experiment_id, lifecycle_stage, status) "
                        "VALUES ('r1', 1, 'active', 'FINISHED')")
        con.execute("UPDATE alembic_version SET version_num='0c779009ac13'")
        con.execute("CREATE TABLE _alembic_tmp_experiments (x INTEGER)")


@pytest.mark.slow  # > 2.5 s: out of the quick loop (-m "not slow"), still in CI
def test_half_created_store_without_runs_is_moved_aside_and_created_again(tmp_path, caplog):
    from fspo.runtime.checks.store_check import prepare_store

    db = tmp_path / "m.db"
    _half_created(db, runs=False)
    prepare_store(f"sqlite:///{db}", "exp")
    assert _complete(db)
    aside = list(tmp_path.glob("m.db.interrupted-*"))
    assert len(aside) == 1 and "moved to" in caplog.text


@pytest.mark.slow  # > 2.5 s: out of the quick loop (-m "not slow"), still in CI
def test_half_migrated_store_with_runs_is_refused_and_untouched(tmp_path):
    from fspo.runtime.checks.errors import user_error
    from fspo.runtime.checks.sqlite_store import HalfMigratedStore
    from fspo.runtime.checks.store_check import prepare_store

    db = tmp_path / "m.db"
    _half_created(db, runs=True)
    before = db.read_bytes()
    with pytest.raises(HalfMigratedStore) as e:
        prepare_store(f"sqlite:///{db}", "exp")
    msg = user_error(e.value)
    assert "\n" not in msg and "_alembic_tmp_experiments" in msg and "mlflow db upgrade" in msg and str(db) in msg
    assert db.read_bytes() == before


@pytest.mark.slow
def test_two_sweeps_started_together_on_a_fresh_store_both_finish(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/m.db"
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "FSPO_MLFLOW_PARENT_RUN_ID",
                                                            "HYDRA_FULL_ERROR")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", HF_HUB_OFFLINE="1")
    cmd = [sys.executable, str(REPO / "experiments" / "run.py"), "-m", "--config-dir", str(REPO / "sweeps"),
           "--config-name", "methods", "+method=fspo", "seed=1", *[o for o in SMALL if not o.startswith("steps")],
           "steps=1", "val.size=0", f"logger.tracking_uri={uri}",
           f"+logger.artifact_location={tmp_path / 'artifacts'}"]
    procs = [subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("methods").experiment_id])
    parents = {r.info.run_id for r in runs if r.data.tags.get("fspo.role") == "sweep_parent"}
    jobs = [r for r in runs if r.info.run_id not in parents]
    assert len(parents) == 2 and len(jobs) == 2
    assert {r.data.tags["mlflow.parentRunId"] for r in jobs} == parents
    assert all(r.info.status == "FINISHED" for r in runs)
    assert len(list((tmp_path / "multirun" / "methods").iterdir())) == 2  # two sweep folders


def test_default_run_folders_are_unique_per_launch(tmp_path):
    cmd = [sys.executable, str(REPO / "experiments" / "run.py"), "--cfg", "hydra", "--resolve", "-p", "hydra.run.dir"]
    procs = [subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    dirs = [p.communicate(timeout=300)[0].strip().splitlines()[-1] for p in procs]
    assert dirs[0] != dirs[1] and all(d.startswith("outputs/") for d in dirs), dirs


def test_ranks_of_one_launch_share_the_folder_id(monkeypatch):
    import fspo.cli as cli

    for env, want in (({"SLURM_JOB_ID": "77"}, "j77"), ({"TORCHELASTIC_RUN_ID": "abc", "LOCAL_RANK": "1"}, "abc"),
                      ({"TORCHELASTIC_RUN_ID": "none", "LOCAL_RANK": "1"}, f"p{os.getppid()}")):
        for k in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "LOCAL_RANK"):
            monkeypatch.delenv(k, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        monkeypatch.setattr(cli, "_LAUNCH_ID", [])
        assert cli.launch_id() == want and cli.launch_id() == want
