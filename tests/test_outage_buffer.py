"""The MLflow outage buffer (fspo/tracking/outage_buffer.py) and its import (fspo/tracking/replay.py).

Owns: the bound (newer metric rows refused and counted, status rows kept, order kept), a torn last line,
and against a real ``mlflow server`` stopped and restarted on the same store and port: writes during the
outage return at once and are buffered, the background retry flushes them once the server is back (every
step once, in order), an error of a server that answers is raised (not buffered), and importing twice
adds nothing, and a buffer left by an earlier attempt in the folder is sent first. Leaves out: a whole training run (tests/test_tracking_midrun_outage.py).
"""
from __future__ import annotations

import json
import time

import pytest
from mlflow import MlflowClient
from mlflow.entities import Metric
from test_tracking_midrun_outage import start_server, stop

from conftest import free_port
from fspo.tracking.outage_buffer import SHORT_RETRIES, BufferedClient, OutageBuffer, TrackingServerDown
from fspo.tracking.replay import read_rows, replay_rows


def _row(step: int) -> dict:
    return {"op": "log_batch", "run_id": "r", "metrics": [["loss", float(step), 1000 + step, step]], "params": [],
            "tags": []}


def test_the_buffer_is_bounded_refuses_newer_metric_rows_and_keeps_order(tmp_path):
    one = len(json.dumps(_row(0), separators=(",", ":"))) + 1
    header = len(json.dumps({"op": "header", "tracking_uri": "http://x", "run_id": "r"})) + 1
    buf = OutageBuffer(tmp_path / "b.jsonl", "http://x", max_bytes=header + 3 * one + 5)  # header + 3 rows fit
    kept = [buf.append(_row(s)) for s in range(6)]
    assert kept == [True, True, True, False, False, False] and buf.refused == 3
    assert buf.append({"op": "set_terminated", "run_id": "r", "status": "FINISHED", "end_time": 5})  # always kept
    uri, rows = read_rows(buf.path)
    assert uri == "http://x" and [r["metrics"][0][3] for r in rows[:3]] == [0, 1, 2] and rows[3]["op"] == "set_terminated"
    assert buf.drop_first(2) == 2 and [r.get("metrics", [[0, 0, 0, None]])[0][3] for r in buf.rows()] == [2, None]
    with buf.path.open("a") as f:
        f.write('{"op": "log_batch", "run_id"')  # a process killed while writing
    assert len(read_rows(buf.path)[1]) == 2


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
    assert [r["metrics"][0][3] for r in read_rows(tmp_path / "b.jsonl")[1] if r["op"] == "log_batch"] == list(range(3, 10))
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
    rows = [{**_row(s), "run_id": run_id} for s in range(3)] + [{**_row(2), "run_id": run_id}]
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
        buf.append({**_row(s), "run_id": run_id})
    client = BufferedClient(MlflowClient(base), buf, backoff_s=(0.2, 1.0))  # e.g. resume=auto in the same folder
    client.log_metric(run_id, "loss", 3.0, step=3)  # queued behind the old rows: order kept
    deadline = time.monotonic() + 30
    while client.in_outage and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not client.in_outage and not buf.path.exists()
    assert [m.step for m in sorted(c.get_metric_history(run_id, "loss"), key=lambda m: m.step)] == [0, 1, 2, 3]
    client.close()
