"""Importing an outage buffer loses nothing and changes nothing it should not.

Owns: a line torn by a kill never swallows the next row; torn, malformed and other-run lines are listed with
their line numbers, never imported, never silently dropped (the import exits 1 and does not call the file
deletable; the running client keeps them in ``mlflow_buffer.unreadable.jsonl``); malformed shapes end in one
line, not a traceback; an old status row never reopens a FINISHED run; a buffer left by an earlier attempt is
sent when the client starts if the server answers (reads work at once), and rows it refuses are moved aside.
Leaves out: a real server going down and up (test_outage_buffer.py).
"""
from __future__ import annotations

import json

import pytest
from mlflow import MlflowClient

from fspo.tracking import outage_buffer
from fspo.tracking.outage_buffer import BufferedClient, OutageBuffer
from fspo.tracking.replay import main, read_buffer


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
              '{"op": "log_batch", "run_id": "R", "metrics": 5}', '{"op": "log_batch", "run_id": "R", "metrics": [["a", 1]]}',
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
