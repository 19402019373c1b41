"""The URL printed at the end of a default run opens the runs list in a real browser.

A tiny run (experiments/run.py, conftest's shared `tiny_run`) ends on its summary block; `mlflow ui` serves the
run's SQLite store on a free loopback port; headless Chromium (Debian package ``chromium``) loads
the printed experiment page and the DOM must list the run. MLflow 3.17 opens the plain experiment
URL on its GenAI view (traces, no runs): the printed URL carries ``?workflowType=machine_learning``.
Skipped where no Chromium is installed (.ci/run installs it when apt-get can).
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from conftest import free_port
from fspo.tracking.run_summary import RULE, UI_URL

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [pytest.mark.slow, pytest.mark.docs,
              pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium not installed")]


def _dom(url: str) -> str:
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=20000", "--dump-dom", url]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180).stdout


def _wait_healthy(base: str, proc: subprocess.Popen, limit_s: float = 180) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, "mlflow ui exited"
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise AssertionError(f"mlflow ui not healthy within {limit_s} s")


def test_printed_url_opens_the_runs_list(tiny_run):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    env.pop("MLFLOW_TRACKING_URI", None)
    tmp_path = tiny_run["dir"]  # conftest's shared tiny run, its store a relative sqlite:///store.db
    lines = tiny_run["stdout"].rstrip().splitlines()
    block = lines[len(lines) - 1 - lines[::-1].index(RULE, 1):]
    rows = {ln.split(":", 1)[0].strip(): ln.split(":", 1)[1].strip() for ln in block[2:-1]}
    run_name = rows["run"].split(" (id ")[0]
    assert rows["open with"] == f"mlflow ui --backend-store-uri sqlite:///{tmp_path / 'store.db'}"

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    ui = subprocess.Popen([sys.executable, "-m", "mlflow", "ui", "--backend-store-uri",
                           f"sqlite:///{tmp_path / 'store.db'}",
                           "--port", str(port), "--workers", "1"], cwd=tmp_path, env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        _wait_healthy(base, ui)
        page = rows["experiment page"].replace(UI_URL, base)
        assert page.endswith("/runs?workflowType=machine_learning")
        dom = _dom(page)
        assert run_name in dom, dom[-2000:]
        plain = _dom(page.split("/runs?")[0])  # what MLflow opens without the parameter: GenAI, no runs listed
        assert run_name not in plain
    finally:
        os.killpg(ui.pid, signal.SIGTERM)  # mlflow ui, its uvicorn worker and job runner: one session
        try:
            ui.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(ui.pid, signal.SIGKILL)
