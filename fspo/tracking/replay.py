"""Importing an MLflow outage buffer into its run: ``python -m fspo.tracking.replay <buffer> [--tracking-uri URI]``.

Owns: `read_rows` (the header and rows of a buffer written by fspo/tracking/outage_buffer.py; a torn
last line, from a process killed while writing, is skipped), `replay_rows` (write rows into their runs,
in order, idempotently: a (metric, step) pair the run already holds and a param it already has are
skipped, tags and statuses are set again) and `main` (the import command; the buffer's own tracking URI
unless ``--tracking-uri`` is given; the file is kept, importing it again adds nothing). Leaves out:
when rows are buffered (fspo/tracking/outage_buffer.py).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Set, Tuple

BATCH = 800  # metrics per log_batch: with 100 params and 100 tags within MLflow's 1000 entries a request


def read_rows(path) -> Tuple[Optional[str], List[Dict[str, Any]]]:
    """(the buffer's tracking URI, its rows without the header)."""
    uri, rows = None, []
    for line in Path(path).read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn last line
        if row.get("op") == "header":
            uri = row.get("tracking_uri")
        else:
            rows.append(row)
    return uri, rows


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
    """Write ``rows`` into their runs with ``client`` (an MlflowClient), in order; returns counts
    ``imported`` / ``present`` (metric values), ``params``, ``tags``, ``statuses``."""
    from mlflow.entities import Metric, Param, RunTag

    have, n = _Present(client), {"imported": 0, "present": 0, "params": 0, "tags": 0, "statuses": 0}
    for row in rows:
        run_id = row["run_id"]
        if row["op"] == "set_terminated":
            if row.get("end_time") is None:
                client.update_run(run_id, status=row["status"])
            else:
                client.set_terminated(run_id, row["status"], row["end_time"])
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
    uri, rows = read_rows(path)
    uri = a.tracking_uri or uri
    if not uri:
        print(f"error: {path} names no tracking URI: pass --tracking-uri", file=sys.stderr)
        return 2
    from mlflow import MlflowClient

    from fspo.tracking.outage_buffer import server_answers

    if str(uri).startswith(("http://", "https://")) and not server_answers(uri, timeout_s=10):
        print(f"error: MLflow server {uri} does not answer: start it, or pass --tracking-uri", file=sys.stderr)
        return 2
    n = replay_rows(MlflowClient(uri), rows)
    runs = sorted({r["run_id"] for r in rows})
    print(f"{n['imported']} metric values imported ({n['present']} already present), {n['params']} params, "
          f"{n['tags']} tags, {n['statuses']} status changes into run(s) {', '.join(runs)} at {uri}; "
          f"{path} can be deleted (importing it again adds nothing)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
