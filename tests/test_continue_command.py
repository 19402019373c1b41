"""The stop line's command, pasted as printed, continues the interrupted run.

Owns: a default run (Hydra's timestamped folder, the default MLflow store in the working directory) stopped
with Ctrl-C after its first step: the stop line names the command; ``resume=auto`` alone in a new folder is
refused with one line naming that run and the same command; the pasted command continues the same MLflow
run to its last step (each step logged once, status FINISHED). Also `continue_command`'s quoting. Leaves out:
which checkpoint a resume takes (test_resume.py).
"""
from __future__ import annotations

import os
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, SMALL
from fspo.runtime.checkpoints.continue_command import continue_command

ARGS = [a for a in SMALL if not a.startswith(("steps=", "val.size="))] + ["steps=6", "val.size=4",
                                                                          "checkpoint.every_n_steps=0"]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])}


def _train_steps(db: Path) -> list:
    try:
        with sqlite3.connect(db, timeout=5) as con:
            return [r[0] for r in con.execute("SELECT step FROM metrics WHERE key='train/loss' ORDER BY step")]
    except sqlite3.Error:
        return []


@pytest.mark.slow  # > 2.5 s: out of the quick loop, still in CI
def test_the_printed_command_continues_the_run(tmp_path):
    run = subprocess.Popen([sys.executable, str(REPO / "experiments" / "run.py"), *ARGS], cwd=tmp_path, env=_env(),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    db, deadline = tmp_path / "mlflow.db", time.monotonic() + 300
    while not _train_steps(db):
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()[0][-3000:]
        time.sleep(0.05)
    os.kill(run.pid, signal.SIGINT)  # Ctrl-C
    log = run.communicate(timeout=300)[0]
    assert run.returncode == 0, log[-3000:]
    stops = [x for x in log.splitlines() if "continue with: " in x]
    assert len(stops) == 1 and "stopped on SIGINT at RL step" in stops[0], log[-3000:]
    command = stops[0].split("continue with: ", 1)[1]
    stopped_at = _train_steps(db)[-1] + 1
    assert 1 <= stopped_at < 6

    fresh = subprocess.run([sys.executable, str(REPO / "experiments" / "run.py"), "resume=auto"], cwd=tmp_path,
                           env=_env(), capture_output=True, text=True, timeout=300)
    errors = [x for x in fresh.stderr.splitlines() if x.startswith("error:")]
    assert fresh.returncode == 2 and len(errors) == 1, fresh.stderr[-3000:]
    assert f"stopped at step {stopped_at} of 6" in errors[0] and errors[0].endswith(command), (errors, command)

    pasted = subprocess.run(["bash", "-c", command], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=400)
    assert pasted.returncode == 0, (pasted.stdout + pasted.stderr)[-3000:]
    assert re.search(rf"continuing from .*step_{stopped_at:06d}\.ckpt", pasted.stdout + pasted.stderr)
    assert _train_steps(db) == list(range(6))  # every step once, in the one MLflow run
    said = pasted.stdout + pasted.stderr  # a graceful stop leaves nothing alarming for the next launch
    assert "without releasing its lock" not in said and not re.search(r"WARNING.*params", said), said[-3000:]
    with sqlite3.connect(db) as con:
        assert con.execute("SELECT status FROM runs").fetchall() == [("FINISHED",)]


def test_a_run_that_exits_on_an_exception_releases_its_lock_cleanly(tmp_path):
    """Hydra's on_run_end is skipped by an exception (a stop signal's SystemExit, Ctrl-C): the lock file is
    emptied at exit all the same, so the next launch does not report a killed run."""
    code = ("import sys; from fspo.runtime.checks.run_lock import acquire; acquire(sys.argv[1]); "
            "raise SystemExit(0)")
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=_env(), capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "run.lock").read_text() == ""


def test_the_command_quotes_what_a_shell_or_hydra_would_split(tmp_path):
    odd = tmp_path / "a b,c'd"
    cmd = continue_command(odd, argv=["experiments/run.py"], cwd=tmp_path)
    assert cmd.startswith(f"cd {tmp_path} && python experiments/run.py ") and cmd.endswith(" resume=auto")
    import shlex

    words = shlex.split(cmd.split(" && ", 1)[1])
    assert words[2].startswith("output_dir='") and "a b,c\\'d" in words[2], words
    assert continue_command(tmp_path, argv=["/usr/bin/fspo-train"], cwd=tmp_path).split(" && ")[1].startswith(
        f"fspo-train output_dir={tmp_path.resolve()} ")
