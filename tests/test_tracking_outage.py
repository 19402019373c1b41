"""A tracking server that is down: evaluate.py fails within 30 s with one line.

Owns: experiments/evaluate.py against an http tracking URI on a closed loopback port (exit 2, one
``error:`` line naming the URI and the setting, no traceback, <= 30 s after the imports). Leaves out:
training's own start-up probe and ``logger_fallback=local`` (test_numerics_guard.py).
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from conftest import REPO

DRIVER = """
import atexit, runpy, sys, time
import torch, mlflow, transformers, lightning  # noqa: F401,E401  (heavy imports before the clock)
clock, t0 = sys.argv[1], time.monotonic()
atexit.register(lambda: open(clock, "w").write(str(time.monotonic() - t0)))
sys.argv = ["experiments/evaluate.py", *sys.argv[2:]]
runpy.run_path("experiments/evaluate.py", run_name="__main__")
"""


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # > 2.5 s: out of the quick loop (-m "not slow"), still in CI
def test_evaluate_with_an_unreachable_server_fails_fast_with_one_line(tmp_path):
    uri = f"http://127.0.0.1:{closed_port()}"
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env.update(MLFLOW_TRACKING_URI=uri, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"), PYTHONWARNINGS="ignore",
               OMP_NUM_THREADS="1")
    clock = tmp_path / "clock.txt"
    p = subprocess.run([sys.executable, "-c", DRIVER, str(clock), "eval_data=[arithmetic]", "limit=2",
                        f"output_dir={tmp_path / 'out'}", f"hydra.run.dir={tmp_path / 'h'}"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=400)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    lines = [x for x in p.stderr.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and uri in lines[0] and "mlflow.tracking_uri" in lines[0], p.stderr[-3000:]
    assert "logger_fallback" not in lines[0]  # a training-only setting
    assert float(clock.read_text()) <= 30
