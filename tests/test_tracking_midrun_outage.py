"""The tracking server dies mid-run: training goes on, metrics are kept and imported later.

Owns: an end-to-end run against a real ``mlflow server`` killed after the first logged step (the run
exits 0 in bounded time, writes its last checkpoint, prints one line naming the buffer and the import
command; after a restart on the same store the import command brings every step in, checked against
the CSV logger of the same run). Leaves out: the buffer's own rules (tests/test_outage_buffer.py) and the
start-up probe (tests/test_tracking_outage.py).
"""
from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import REPO, SMALL, free_port
from fspo.tracking.replay import read_rows

STEPS = 8
ARGS = [o for o in SMALL if not o.startswith("steps")] + [f"steps={STEPS}", "val.size=0", "+extra_loggers=[csv]",
                                                          "logger.experiment_name=outage"]


def start_server(tmp_path: Path, port: int) -> subprocess.Popen:
    """`mlflow server` on ``port`` over ``tmp_path/m.db``; returns once /health answers."""
    log = open(tmp_path / f"server-{port}.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{tmp_path}/m.db",
                             "--artifacts-destination", str(tmp_path / "artifacts"), "--host", "127.0.0.1",
                             "--port", str(port), "--workers", "1"], cwd=tmp_path,
                            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).read()
            return proc
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                stop(proc)
                raise RuntimeError(f"mlflow server did not start: {(tmp_path / f'server-{port}.log').read_text()[-2000:]}") from None
            time.sleep(0.5)


def stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the server's own process group (uvicorn worker included)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def _api(base: str, path: str, body=None) -> dict:
    req = urllib.request.Request(base + path, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as r:
        return json.loads(r.read())


def logged_metrics(base: str) -> int:
    """How many metrics of a training step (step >= 1) the run of experiment ``outage`` holds (0 while none)."""
    try:
        exp = _api(base, "/api/2.0/mlflow/experiments/get-by-name?experiment_name=outage")["experiment"]
        runs = _api(base, "/api/2.0/mlflow/runs/search", {"experiment_ids": [exp["experiment_id"]]}).get("runs", [])
    except OSError:
        return 0
    return sum(int(m["step"]) >= 1 for r in runs for m in r["data"].get("metrics", []))


def csv_pairs(out: Path) -> set:
    """(key, step) of every value the CSV logger of the run wrote."""
    import csv

    pairs = set()
    for f in out.glob("csv/**/metrics.csv"):
        for row in csv.DictReader(f.open()):
            pairs |= {(k, int(row["step"])) for k, v in row.items() if k not in ("step", "epoch") and v not in ("", None)}
    return pairs


@pytest.mark.slow
def test_server_killed_mid_run_training_goes_on_and_the_buffer_imports(tmp_path):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = start_server(tmp_path, port)
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "HYDRA_FULL_ERROR")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO))
    out, log = tmp_path / "out", open(tmp_path / "run.log", "w")
    run = subprocess.Popen([sys.executable, str(REPO / "experiments" / "run.py"), *ARGS, f"output_dir={out}",
                            f"logger.tracking_uri={base}", f"hydra.run.dir={tmp_path / 'h'}"], cwd=tmp_path, env=env,
                           stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while logged_metrics(base) == 0:  # the first step reached the server
            assert run.poll() is None and time.monotonic() < deadline, (tmp_path / "run.log").read_text()[-3000:]
            time.sleep(0.3)
        stop(server)
        t_kill = time.monotonic()
        rc = run.wait(timeout=240)  # main: ~8 minutes of MLflow retries, then a traceback
        after_kill = time.monotonic() - t_kill
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
        if server.poll() is None:
            stop(server)
    text = (tmp_path / "run.log").read_text()
    print(f"run ended {after_kill:.1f} s after the server was killed, rc={rc}")
    assert rc == 0 and "Traceback" not in text, text[-4000:]
    assert after_kill < 120, f"the run needed {after_kill:.0f} s after the server died"
    assert (out / "checkpoints" / f"step_{STEPS:06d}.ckpt").is_file(), text[-3000:]  # checkpoints never wait
    lines = [x for x in text.splitlines() if "python -m fspo.tracking.replay" in x]
    assert len(lines) == 1, text[-4000:]
    m = re.search(r"(python -m fspo\.tracking\.replay .*)$", lines[0])
    buffer = Path(shlex.split(m.group(1))[3])
    assert buffer.is_file() and str(out) in str(buffer), lines[0]
    buffered = {m[3] for r in read_rows(buffer)[1] for m in r.get("metrics", [])}
    assert len(buffered & set(range(1, STEPS))) >= 2, buffered  # the server died mid-run, not at the end

    port2 = free_port()
    base2 = f"http://127.0.0.1:{port2}"
    server = start_server(tmp_path, port2)  # the same store, back again
    try:
        cmd = shlex.split(m.group(1))[1:] + ["--tracking-uri", base2]
        for _attempt in range(2):  # idempotent: the second import adds nothing
            p = subprocess.run([sys.executable, *cmd], cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
            assert p.returncode == 0, p.stderr[-3000:]
        assert "0 metric values imported" in p.stdout, p.stdout
        from mlflow import MlflowClient

        client = MlflowClient(base2)
        run_id = (out / "mlflow_run_id").read_text().strip()
        info = client.get_run(run_id)
        want = csv_pairs(out)
        assert {k for k, _ in want} and max(s for _, s in want) >= STEPS - 1, want
        have = {(k, h.step) for k in {k for k, _ in want} for h in client.get_metric_history(run_id, k)}
        assert want <= have, sorted(want - have)[:20]
        for k in {k for k, _ in want}:  # one value per (metric, step)
            steps = [h.step for h in client.get_metric_history(run_id, k)]
            assert len(steps) == len(set(steps)), (k, steps)
        assert info.info.status == "FINISHED", info.info.status
    finally:
        stop(server)
