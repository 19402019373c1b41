"""A tracking server that is down: training goes on and loses nothing, evaluation fails fast with one line.

Owns:
- at start: experiments/evaluate.py against an http tracking URI on a closed loopback port (exit 2, one
  ``error:`` line naming the URI and the setting, no traceback, <= 30 s after the imports);
- mid-run: an end-to-end run against a real ``mlflow server`` killed after the first logged step (the run exits
  0 in bounded time, writes its last checkpoint, prints one line naming the buffer and the import command;
  after a restart on the same store the import command brings every step in, checked against the CSV logger
  of the same run, and a second import adds nothing);
- the outage buffer (fspo/tracking/outage_buffer.py) against a real ``mlflow server`` stopped and restarted on
  the same store and port: its bound (newer metric rows refused and counted, status rows kept, order kept),
  writes during the outage return at once and are buffered, the background retry flushes them once the server
  is back (every step once, in order), an error of a server that answers is raised (not buffered), and a
  buffer left by an earlier attempt in the folder is sent first;
- the import (fspo/tracking/replay.py): importing twice adds nothing; a line torn by a kill never swallows the
  next row; torn, malformed and other-run lines are listed with their line numbers, never imported, never
  silently dropped (the import exits 1 and does not call the file deletable; the running client keeps them in
  ``mlflow_buffer.unreadable.jsonl``); malformed shapes end in one line, not a traceback; an old status row
  never reopens a FINISHED run; a leftover buffer is sent when the client starts if the server answers (reads
  work at once), and rows it refuses are moved aside.
Leaves out: training's own start-up probe and ``logger_fallback=local`` (test_numerics_guard.py).
"""
from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from mlflow import MlflowClient
from mlflow.entities import Metric

from conftest import REPO, SMALL, free_port
from fspo.tracking import outage_buffer
from fspo.tracking.outage_buffer import SHORT_RETRIES, BufferedClient, OutageBuffer, TrackingServerDown
from fspo.tracking.replay import main, read_buffer, replay_rows

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


STEPS = 8
ARGS = [o for o in SMALL if not o.startswith("steps")] + [f"steps={STEPS}", "val.size=0", "+extra_loggers=[csv]",
                                                          "logger.experiment_name=outage"]


def start_server(tmp_path: Path, port: int) -> subprocess.Popen:
    """`mlflow server` on ``port`` over ``tmp_path/m.db``; returns once /health answers."""
    log = open(tmp_path / f"server-{port}.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri",
                             f"sqlite:///{tmp_path}/m.db",
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
                tail = (tmp_path / f'server-{port}.log').read_text()[-2000:]
                raise RuntimeError(f"mlflow server did not start: {tail}") from None
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
            pairs |= {(k, int(row["step"])) for k,
                      v in row.items() if k not in ("step", "epoch") and v not in ("", None)}
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
    buffered = {m[3] for r in read_buffer(buffer).rows for m in r.get("metrics", [])}
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


def test_the_buffer_is_bounded_refuses_newer_metric_rows_and_keeps_order(tmp_path):
    one = len(json.dumps(_row("r", 0), separators=(",", ":"))) + 1
    header = len(json.dumps({"op": "header", "tracking_uri": "http://x", "run_id": "r"})) + 1
    buf = OutageBuffer(tmp_path / "b.jsonl", "http://x", max_bytes=header + 3 * one + 5)  # header + 3 rows fit
    kept = [buf.append(_row("r", s)) for s in range(6)]
    assert kept == [True, True, True, False, False, False] and buf.refused == 3
    assert buf.append({"op": "set_terminated", "run_id": "r", "status": "FINISHED", "end_time": 5})  # always kept
    read = read_buffer(buf.path)
    uri, rows = read.uri, read.rows
    assert uri == "http://x" and [r["metrics"][0][3] for r in rows[:3]] == [0, 1,
                                                                            2] and rows[3]["op"] == "set_terminated"
    assert buf.drop_first(2) == 2 and [r.get("metrics", [[0, 0, 0, None]])[0][3] for r in buf.rows()] == [2, None]
    with buf.path.open("a") as f:
        f.write('{"op": "log_batch", "run_id"')  # a process killed while writing
    assert len(read_buffer(buf.path).rows) == 2


@pytest.fixture
def server(tmp_path, monkeypatch):
    for k, v in SHORT_RETRIES.items():
        monkeypatch.setenv(k, v)
    port = free_port()
    procs = [start_server(tmp_path, port)]
    yield port, procs
    for p in procs:
        if p.poll() is None:
            stop(p)


@pytest.mark.slow  # > 2.5 s: out of the quick loop (-m "not slow"), still in CI
def test_writes_during_an_outage_are_buffered_and_flushed_when_the_server_is_back(tmp_path, server):
    port, procs = server
    base = f"http://127.0.0.1:{port}"
    client = BufferedClient(MlflowClient(base), OutageBuffer(tmp_path / "b.jsonl", base), backoff_s=(0.3, 1.0))
    run_id = client.create_run(client.create_experiment("e")).info.run_id
    with pytest.raises(Exception) as e:  # the server answers: a real error is raised, nothing buffered
        client.log_batch("no-such-run", metrics=[Metric("loss", 0.0, 1, 0)])
    assert not isinstance(e.value, TrackingServerDown) and not client.in_outage
    for s in range(3):
        client.log_metric(run_id, "loss", float(s), timestamp=1000 + s, step=s)
    stop(procs.pop())
    t0 = time.monotonic()
    client.log_metric(run_id, "loss", 3.0, timestamp=1003, step=3)  # detects the outage (short MLflow retries)
    first = time.monotonic() - t0
    t0 = time.monotonic()
    for s in range(4, 10):
        client.log_metric(run_id, "loss", float(s), timestamp=1000 + s, step=s)
    client.set_terminated(run_id, "FINISHED")
    rest = time.monotonic() - t0
    print(f"first write after the kill: {first:.2f} s; 6 more writes + status: {rest:.3f} s")
    assert client.in_outage and first < 30 and rest < 1.0
    rows = read_buffer(tmp_path / "b.jsonl").rows
    assert [r["metrics"][0][3] for r in rows if r["op"] == "log_batch"] == list(range(3, 10))
    with pytest.raises(TrackingServerDown):  # a read during the outage: at once, one line
        client.get_metric_history(run_id, "loss")
    assert client.get_run(run_id).info.run_id == run_id  # as last seen (Lightning's finalize asks)

    procs.append(start_server(tmp_path, port))  # back, same store and port
    deadline = time.monotonic() + 60
    while client.in_outage and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not client.in_outage and not (tmp_path / "b.jsonl").exists()
    hist = MlflowClient(base).get_metric_history(run_id, "loss")
    assert sorted((m.step, m.value) for m in hist) == [(s, float(s)) for s in range(10)]
    assert MlflowClient(base).get_run(run_id).info.status == "FINISHED"
    client.log_metric(run_id, "loss", 10.0, step=10)  # direct again
    assert len(MlflowClient(base).get_metric_history(run_id, "loss")) == 11
    client.close()


def test_importing_twice_adds_nothing(tmp_path, server):
    port, _ = server
    c = MlflowClient(f"http://127.0.0.1:{port}")
    run_id = c.create_run(c.create_experiment("e")).info.run_id
    c.log_metric(run_id, "loss", 0.0, step=0)
    rows = [_row(run_id, s) for s in range(3)] + [_row(run_id, 2)]
    rows[0]["params"], rows[0]["tags"] = [["lr", "0.1"]], [["t", "x"]]
    assert replay_rows(c, rows) == {"imported": 2, "present": 2, "params": 1, "tags": 1, "statuses": 0,
                                   "stale": 0}
    assert replay_rows(c, rows)["imported"] == 0
    assert sorted(m.step for m in c.get_metric_history(run_id, "loss")) == [0, 1, 2]


def test_a_buffer_left_by_an_earlier_attempt_is_sent_first(tmp_path, server):
    port, _ = server
    base = f"http://127.0.0.1:{port}"
    c = MlflowClient(base)
    run_id = c.create_run(c.create_experiment("e")).info.run_id
    buf = OutageBuffer(tmp_path / "b.jsonl", base)
    for s in range(3):
        buf.append(_row(run_id, s))
    client = BufferedClient(MlflowClient(base), buf, backoff_s=(0.2, 1.0))  # e.g. resume=auto in the same folder
    client.log_metric(run_id, "loss", 3.0, step=3)  # queued behind the old rows: order kept
    deadline = time.monotonic() + 30
    while client.in_outage and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not client.in_outage and not buf.path.exists()
    assert [m.step for m in sorted(c.get_metric_history(run_id, "loss"), key=lambda m: m.step)] == [0, 1, 2, 3]
    client.close()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    uri = f"sqlite:///{tmp_path_factory.mktemp('replay') / 'm.db'}"
    c = MlflowClient(uri)
    exp = c.create_experiment("replay")
    return uri, c, exp


def _run(store) -> str:
    uri, c, exp = store
    return c.create_run(exp).info.run_id


def _row(run_id: str, step: int) -> dict:
    return {"op": "log_batch", "run_id": run_id, "metrics": [["loss", float(step), 1000 + step, step]],
            "params": [], "tags": []}


def test_a_torn_line_never_swallows_the_next_row(tmp_path):
    buf = OutageBuffer(tmp_path / "b.jsonl", "http://x")
    buf.append(_row("r", 0))
    with buf.path.open("a") as f:
        f.write('{"op": "log_batch", "run_id": "r", "metr')  # killed mid-append
    buf.append(_row("r", 2))
    got = read_buffer(buf.path)
    assert [r["metrics"][0][3] for r in got.rows] == [0, 2] and got.bad == [(3, "torn or not JSON")]
    assert buf.drop_first(1) == 1 and buf.set_aside == 1  # the torn line is kept aside, not dropped
    assert buf.aside_path.read_text().startswith('{"op": "log_batch", "run_id": "r", "metr')


BAD_SHAPES = ['[]', '"text"', '{"op": "log_batch"}', '{"op": "drop_table", "run_id": "R"}',
              '{"op": "log_batch", "run_id": "R", "metrics": 5}',
              '{"op": "log_batch", "run_id": "R", "metrics": [["a", 1]]}',
              '{"op": "log_batch", "run_id": "R", "metrics": [["a", "x", 1, 0]]}',
              '{"op": "log_batch", "run_id": "R", "metrics": [["a", 1.0, 1, "0"]]}',
              '{"op": "log_batch", "run_id": "R", "params": [["a"]]}',
              '{"op": "set_terminated", "run_id": "R", "status": "PWNED", "end_time": 1}']


def test_malformed_torn_and_other_run_lines_are_listed_not_imported(tmp_path, store, capsys):
    uri, c, _ = store
    mine, other = _run(store), _run(store)
    lines = [json.dumps({"op": "header", "tracking_uri": uri, "run_id": mine}), json.dumps(_row(mine, 0)),
             *[s.replace('"R"', json.dumps(mine)) for s in BAD_SHAPES], json.dumps(_row(other, 0)),
             json.dumps(_row(mine, 1)), '{"op": "log_batch", "run_id": "' + mine]
    f = tmp_path / "mlflow_buffer.jsonl"
    f.write_text("\n".join(lines))
    assert main([str(f)]) == 1
    out = capsys.readouterr().out
    assert "2 metric values imported" in out and f"{len(BAD_SHAPES) + 2} lines of {f} were NOT imported" in out, out
    assert "can be deleted" not in out and "Traceback" not in out
    assert sorted(m.step for m in c.get_metric_history(mine, "loss")) == [0, 1]
    assert c.get_metric_history(other, "loss") == []  # another run's row never lands


def test_an_old_status_row_never_reopens_a_finished_run(tmp_path, store, capsys):
    uri, c, _ = store
    run = _run(store)
    buf = OutageBuffer(tmp_path / "b.jsonl", uri)
    buf.append({"op": "set_terminated", "run_id": run, "status": "RUNNING", "end_time": None, "time": 1000})
    buf.append(_row(run, 0))
    c.set_terminated(run, "FINISHED")  # the run ended later (a resume, the server back)
    assert main([str(buf.path)]) == 0
    assert "1 older status changes skipped" in capsys.readouterr().out
    assert c.get_run(run).info.status == "FINISHED"


def test_a_leftover_buffer_is_sent_at_start_when_the_server_answers(tmp_path, store, monkeypatch):
    uri, c, _ = store
    run = _run(store)
    buf = OutageBuffer(tmp_path / "mlflow_buffer.jsonl", uri)
    for s in range(3):
        buf.append(_row(run, s))
    monkeypatch.setattr(outage_buffer, "server_answers", lambda *a, **k: True)
    client = BufferedClient(MlflowClient(uri), buf)  # resume=auto in the folder, server up
    assert not client.in_outage and not buf.path.exists()
    assert sorted(m.step for m in client.get_metric_history(run, "loss")) == [0, 1, 2]  # reads work at once
    client.close()

    bad = OutageBuffer(tmp_path / "again.jsonl", uri)
    bad.append(_row("0" * 32, 0))  # a run this store does not have: refused by the server
    client = BufferedClient(MlflowClient(uri), bad)
    assert not client.in_outage and not bad.path.exists()
    kept = list(tmp_path.glob("again.rejected-*.jsonl"))
    assert len(kept) == 1 and "0" * 32 in kept[0].read_text()  # moved aside, not deleted
    client.close()
