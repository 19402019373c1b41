"""A stop signal outside the training loop stops the run at once.

Owns: SIGTERM (and Ctrl-C) during model loading, Lightning's setup and the step-0 validation, each in a
subprocess calling ``train()``: the run stops with SystemExit code 0 before any training step, its MLflow
run is KILLED, and one line names the command that continues it. Leaves out: signals inside the training
loop (test_signals.py, test_stop_signal.py) and pasting that command (test_continue_command.py).
"""
from __future__ import annotations

import os
import sqlite3
import subprocess
import sys

import pytest

from conftest import REPO, SMALL

SCRIPT = r"""
import os, signal, sys
from pathlib import Path
from conftest import compose_config
import fspo.train as T
from fspo.update.module import RLModule
stage, sig, out = sys.argv[1], getattr(signal, sys.argv[2]), Path(sys.argv[3])
cfg = compose_config({args!r}, output_dir=out / "run", tracking_uri=f"sqlite:///{{out / 'm.db'}}",
                     artifact_location=out / "art")
def kill():
    os.kill(os.getpid(), sig)
if stage == "load":
    real = T.load_policy
    def load(*a, **k):
        kill()
        return real(*a, **k)
    T.load_policy = load
elif stage == "setup":
    real_setup = RLModule.setup
    def setup(self, stage=None):
        kill()
        return real_setup(self, stage)
    RLModule.setup = setup
else:
    real_val = RLModule.validation_step
    def validation_step(self, *a, **k):
        if self.trainer.state.fn == "validate":
            kill()
        return real_val(self, *a, **k)
    RLModule.validation_step = validation_step
T.train(cfg)
print("TRAINED TO THE END")
"""


@pytest.mark.slow  # > 2.5 s: out of the quick loop, still in CI
@pytest.mark.parametrize("stage, sig", [("load", "SIGTERM"), ("setup", "SIGTERM"), ("validation", "SIGTERM"),
                                        ("validation", "SIGINT")])
def test_a_stop_signal_before_training_stops_at_once(tmp_path, stage, sig):
    args = [a for a in SMALL if not a.startswith("steps=")] + ["steps=6"]
    script = SCRIPT.format(args=args)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-c", script, stage, sig, str(tmp_path)], capture_output=True, text=True,
                       env=env, timeout=300)
    log = p.stdout + p.stderr
    assert p.returncode == 0, log[-3000:]
    assert "TRAINED TO THE END" not in log and "Traceback" not in log, log[-3000:]
    lines = [x for x in log.splitlines() if "continue with:" in x]
    assert len(lines) == 1 and f"stopped on {sig} before the first training step" in lines[0], log[-3000:]
    assert f"{tmp_path / 'run'} resume=auto" in lines[0], lines
    with sqlite3.connect(tmp_path / "m.db") as con:
        runs = con.execute("SELECT status FROM runs").fetchall()
        steps = con.execute("SELECT count(*) FROM metrics WHERE key='train/loss'").fetchone()[0]
    assert steps == 0
    assert runs == [("KILLED",)] or (stage == "load" and runs in ([], [("KILLED",)])), runs
    assert not list((tmp_path / "run").glob("checkpoints/*.ckpt"))
