"""Importing an MLflow outage buffer into its run: ``python -m fspo.tracking.replay <buffer> [--tracking-uri URI]``.

Rows are written in order and idempotently (a (metric, step) pair or param the run already holds is skipped),
so importing again adds nothing. A torn, malformed or foreign line is listed with its number and never
imported (exit 1); an unreadable file or a failing import exits 2 with one line.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Set, Tuple

BATCH = 800  # metrics per log_batch: with 100 params and 100 tags within MLflow's 1000 entries a request
TERMINAL = ("FINISHED", "FAILED", "KILLED")


@dataclass
class BufferFile:
    """A buffer as read: its URI and run, the rows to import, ``bad``: (line number, why) of the others."""

    uri: Optional[str] = None
    run_id: Optional[str] = None
    rows: List[Dict[str, Any]] = field(default_factory=list)
    bad: List[Tuple[int, str]] = field(default_factory=list)


def _num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _pairs(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(p, list) and len(p) == 2 and all(isinstance(v, str) for v in p)
                                       for p in x)


def row_problem(row: Any) -> Optional[str]:
    """Why ``row`` is not a buffer row fspo writes (None when it is one)."""
    if not isinstance(row, dict):
        return f"not an object ({type(row).__name__})"
    if not isinstance(row.get("run_id"), str) or not row["run_id"]:
        return "no run_id"
    if row.get("op") == "set_terminated":
        if row.get("status") not in (*TERMINAL, "RUNNING", "SCHEDULED"):
            return f"status {row.get('status')!r} is not an MLflow run status"
        if not all(row.get(k) is None or _num(row.get(k)) for k in ("end_time", "time")):
            return "end_time is not a number"
        return None
    if row.get("op") != "log_batch":
        return f"unknown op {row.get('op')!r}"
    metrics = row.get("metrics", [])
    if not isinstance(metrics, list) or not all(
            isinstance(m, list) and len(m) == 4 and isinstance(m[0], str) and _num(m[1]) and _num(m[2])
            and isinstance(m[3], int) and not isinstance(m[3], bool) for m in metrics):
        return "metrics are not [key, value, timestamp_ms, step] lists"
    if not _pairs(row.get("params", [])) or not _pairs(row.get("tags", [])):
        return "params or tags are not [key, value] string pairs"
    return None


def read_buffer(path) -> BufferFile:
    """The `BufferFile` at ``path``; a line that is not a well-formed row of the buffer's run goes to ``bad``."""
    out = BufferFile()
    for i, line in enumerate(Path(path).read_text(errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            out.bad.append((i, "torn or not JSON"))
            continue
        if isinstance(row, dict) and row.get("op") == "header":
            out.uri = row.get("tracking_uri") if isinstance(row.get("tracking_uri"), str) else None
            out.run_id = row.get("run_id") if isinstance(row.get("run_id"), str) else out.run_id
            continue
        why = row_problem(row)
        if why is None and out.run_id is not None and row["run_id"] != out.run_id:
            why = f"row for run {row['run_id']}, the buffer is run {out.run_id}'s"
        if why is not None:
            out.bad.append((i, why))
            continue
        out.run_id = out.run_id or row["run_id"]
        out.rows.append(row)
    return out


class _Present:
    """The (metric, step) pairs and params a run already holds, fetched once per run and key."""

    def __init__(self, client):
        self.client, self.steps, self.params = client, {}, {}

    def has_step(self, run_id: str, key: str, step: int) -> bool:
        if (run_id, key) not in self.steps:
            self.steps[(run_id, key)] = {m.step for m in self.client.get_metric_history(run_id, key)}
        return step in self.steps[(run_id, key)]

    def has_param(self, run_id: str, key: str) -> bool:
        if run_id not in self.params:
            self.params[run_id] = set(self.client.get_run(run_id).data.params)
        return key in self.params[run_id]


def replay_rows(client, rows: List[Dict[str, Any]]) -> Dict[str, int]:
    """Write ``rows`` into their runs with an MlflowClient, in order; returns counts ``imported`` / ``present``
    (metric values), ``params``, ``tags``, ``statuses`` and ``stale`` (status rows older than the run's terminal
    status: an old buffer never reopens a FINISHED run)."""
    from mlflow.entities import Metric, Param, RunTag

    have, n = _Present(client), {"imported": 0, "present": 0, "params": 0, "tags": 0, "statuses": 0, "stale": 0}
    status: Dict[str, Tuple[str, Optional[int], bool]] = {}  # run -> (status, its time, set by this replay)
    for row in rows:
        run_id = row["run_id"]
        if row["op"] == "set_terminated":
            if run_id not in status:
                info = client.get_run(run_id).info
                status[run_id] = (str(info.status), info.end_time, False)
            now, when, ours = status[run_id]
            t = row.get("time", row.get("end_time"))
            if now in TERMINAL and not ours and (t is None or when is None or t <= when):
                n["stale"] += 1  # the run ended after this row was buffered: never reopened or re-ended
                continue
            if row.get("end_time") is None:
                client.update_run(run_id, status=row["status"])
            else:
                client.set_terminated(run_id, row["status"], row["end_time"])
            status[run_id] = (str(row["status"]), t, True)
            n["statuses"] += 1
            continue
        metrics: List[Metric] = []
        seen: Set[Tuple[str, int]] = set()
        for key, value, ts, step in row.get("metrics", []):
            if have.has_step(run_id, key, int(step)) or (key, int(step)) in seen:
                n["present"] += 1
                continue
            seen.add((key, int(step)))
            metrics.append(Metric(key, float(value), int(ts), int(step)))
        params = [Param(k, v) for k, v in row.get("params", []) if not have.has_param(run_id, k)]
        tags = [RunTag(k, v) for k, v in row.get("tags", [])]
        j = 0
        while metrics[j * BATCH:] or params[j * 100:] or tags[j * 100:]:  # <= 1000 entries a request
            client.log_batch(run_id, metrics=metrics[j * BATCH:(j + 1) * BATCH], params=params[j * 100:(j + 1) * 100],
                             tags=tags[j * 100:(j + 1) * 100])
            j += 1
        for m in metrics:
            have.steps.setdefault((run_id, m.key), set()).add(m.step)
        have.params.setdefault(run_id, set()).update(p.key for p in params)
        n["imported"] += len(metrics)
        n["params"] += len(params)
        n["tags"] += len(tags)
    return n


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fspo.tracking.replay",
                                 description="Import the metrics a run buffered while its MLflow server was down.")
    ap.add_argument("buffer", help="the run's mlflow_buffer.jsonl (named in the run's last lines)")
    ap.add_argument("--tracking-uri", default=None, help="the server to import into (default: the buffer's own)")
    a = ap.parse_args(argv)
    path = Path(a.buffer)
    if not path.is_file():
        print(f"error: {path} does not exist: pass the buffer file the run named", file=sys.stderr)
        return 2
    try:
        buf = read_buffer(path)
    except OSError as e:
        print(f"error: {path} cannot be read ({e.strerror or e}): pass the buffer file the run named", file=sys.stderr)
        return 2
    uri = a.tracking_uri or buf.uri
    if not uri:
        print(f"error: {path} names no tracking URI: pass --tracking-uri", file=sys.stderr)
        return 2
    from mlflow import MlflowClient

    from fspo.tracking.outage_buffer import server_answers

    if str(uri).startswith(("http://", "https://")) and not server_answers(uri, timeout_s=10):
        print(f"error: MLflow server {uri} does not answer: start it, or pass --tracking-uri", file=sys.stderr)
        return 2
    try:
        n = replay_rows(MlflowClient(uri), buf.rows)
    except Exception as e:  # noqa: BLE001 - e.g. the run does not exist in that store: one line
        print(f"error: importing {path} into {uri} failed ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
              f"nothing after the failing row was imported, importing again is safe", file=sys.stderr)
        return 2
    stale = f", {n['stale']} older status changes skipped (the run ended later)" if n["stale"] else ""
    print(f"{n['imported']} metric values imported ({n['present']} already present), {n['params']} params, "
          f"{n['tags']} tags, {n['statuses']} status changes{stale} into run {buf.run_id or '-'} at {uri}")
    if buf.bad:
        shown = "; ".join(f"line {i}: {why}" for i, why in buf.bad[:5]) + (" ..." if len(buf.bad) > 5 else "")
        print(f"warning: {len(buf.bad)} lines of {path} were NOT imported ({shown}): keep the file if they matter")
        return 1
    print(f"{path} can be deleted (importing it again adds nothing)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
