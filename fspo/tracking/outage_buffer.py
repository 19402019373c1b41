"""Keeping an MLflow run's writes while its http(s) tracking server is down mid-run.

A write that fails while the server does not answer ``/health`` goes to a bounded JSONL buffer (buffer_file.py),
and so does every later write until a background thread, probing with backoff, has replayed the buffer into the
run (replay.py). Calls that cannot be buffered (reads, artifacts) raise `TrackingServerDown` during an outage,
except ``get_run`` of a run seen before, which answers as last seen. Local stores need none of this.
"""
from __future__ import annotations

import logging
import os
import shlex
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Dict, Optional

from fspo.tracking.buffer_file import BUFFER_FILE, MAX_BYTES, OutageBuffer

log = logging.getLogger(__name__)

# While the buffer takes over, MLflow's own in-line retries (7, backoff factor 2: minutes per call) only
# stall training: a few short tries, unless the user set these variables.
SHORT_RETRIES = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                 "MLFLOW_HTTP_REQUEST_TIMEOUT": "15"}


class TrackingServerDown(RuntimeError):
    """The tracking server is down and the call cannot be buffered (a read, an artifact)."""


def health_error(uri: str, timeout_s: float = 2.0) -> Optional[str]:
    """None when ``GET <uri>/health`` gets any HTTP answer within ``timeout_s``, else why not."""
    try:
        urllib.request.urlopen(str(uri).rstrip("/") + "/health", timeout=timeout_s).close()
    except urllib.error.HTTPError:
        return None
    except (urllib.error.URLError, OSError) as e:
        return str(getattr(e, "reason", e))
    return None


def server_answers(uri: str, timeout_s: float = 2.0) -> bool:
    return health_error(uri, timeout_s) is None


class BufferedClient:
    """An MlflowClient whose writes survive an outage of its http(s) server."""

    def __init__(self, client, buffer: OutageBuffer, backoff_s=(1.0, 30.0)):
        self._client, self._buffer, self._backoff = client, buffer, backoff_s
        self._outage = threading.Event()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._runs: Dict[str, Any] = {}
        self._flushing = threading.Lock()
        if buffer.rows():  # left by an earlier attempt in this folder: those go first
            self._send_leftover()

    def _send_leftover(self) -> None:
        """An earlier attempt's buffer: sent now when the server answers; rows it rejects are moved aside."""
        buf = self._buffer
        if not server_answers(buf.tracking_uri):
            self._start_outage()
            return
        self._outage.set()  # writes queue behind the old rows while they are sent
        if self.flush():
            return
        if not server_answers(buf.tracking_uri):  # down again meanwhile: buffered, retried in the background
            self._start_outage()
            return
        kept = buf.path.with_name(f"{buf.path.stem}.rejected-{int(time.time())}.jsonl")
        with buf.lock:
            buf.path.replace(kept)
            self._outage.clear()
        log.warning("MLflow server %s answers but refused the rows an earlier attempt buffered in %s (see the debug "
                    "log): moved to %s, the run goes on; import them by hand with python -m fspo.tracking.replay %s",
                    buf.tracking_uri, buf.path, kept, shlex.quote(str(kept)))

    @property
    def in_outage(self) -> bool:
        return self._outage.is_set()

    def __getattr__(self, name):
        attr = getattr(self._client, name)
        if callable(attr) and self._outage.is_set():
            def down(*args, **kwargs):
                raise TrackingServerDown(f"MLflow server {self._buffer.tracking_uri} is down: {name} not done")
            return down
        return attr

    # the run as last seen: Lightning's finalize asks for it before marking it terminated
    def get_run(self, run_id):
        if self._outage.is_set() and run_id in self._runs:
            return self._runs[run_id]  # as last seen: metrics/params/status may be stale
        self._runs[run_id] = self.__getattr__("get_run")(run_id)
        return self._runs[run_id]

    def create_run(self, *args, **kwargs):
        run = self._client.create_run(*args, **kwargs)
        self._runs[run.info.run_id] = run
        return run

    def log_batch(self, run_id, metrics=(), params=(), tags=(), **kw):
        row = {"op": "log_batch", "run_id": run_id, "metrics": [[m.key, m.value, m.timestamp, m.step] for m in metrics],
               "params": [[p.key, p.value] for p in params], "tags": [[t.key, t.value] for t in tags]}
        self._write(lambda: self._client.log_batch(run_id, metrics=metrics, params=params, tags=tags, **kw), row)

    def log_metric(self, run_id, key, value, timestamp=None, step=None, **kw):
        from mlflow.entities import Metric

        ts = int(timestamp if timestamp is not None else time.time() * 1000)
        self.log_batch(run_id, metrics=[Metric(key, float(value), ts, int(step or 0))])

    def log_param(self, run_id, key, value, **kw):
        from mlflow.entities import Param

        self.log_batch(run_id, params=[Param(key, str(value))])

    def set_tag(self, run_id, key, value, **kw):
        from mlflow.entities import RunTag

        self.log_batch(run_id, tags=[RunTag(key, str(value))])

    def set_terminated(self, run_id, status=None, end_time=None):
        end = int(end_time if end_time is not None else time.time() * 1000)
        self._write(lambda: self._client.set_terminated(run_id, status, end),
                    {"op": "set_terminated", "run_id": run_id, "status": status or "FINISHED", "end_time": end,
                     "time": end})

    def update_run(self, run_id, status=None, name=None):
        if name is not None or not self._outage.is_set():
            return self._write(lambda: self._client.update_run(run_id, status=status, name=name), None)
        self._buffer.append({"op": "set_terminated", "run_id": run_id, "status": status, "end_time": None,
                             "time": int(time.time() * 1000)})

    def _write(self, call, row: Optional[Dict[str, Any]]) -> None:
        with self._buffer.lock:
            if self._outage.is_set() and row is not None:
                self._buffer.append(row)
                return
        try:
            call()
        except Exception as e:  # noqa: BLE001 - only an unreachable server is buffered; anything else is raised
            if row is None or server_answers(self._buffer.tracking_uri):
                raise
            log.warning("MLflow server %s stopped answering (%s): training goes on, metrics are buffered in %s and "
                        "sent when it is back", self._buffer.tracking_uri, str(e).splitlines()[0][:160],
                        self._buffer.path)
            with self._buffer.lock:
                self._buffer.append(row)
                self._start_outage()

    def _start_outage(self) -> None:
        self._outage.set()
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._retry, name="mlflow-buffer", daemon=True)
            self._thread.start()

    def _retry(self) -> None:
        delay, cap = self._backoff
        while not self._stop.is_set():
            if server_answers(self._buffer.tracking_uri) and self.flush():
                return
            self._stop.wait(delay)
            delay = min(cap, delay * 2)

    def flush(self) -> bool:
        """Replay the buffered rows into the server; True when the buffer is empty and the outage over."""
        from fspo.tracking.replay import replay_rows

        buf = self._buffer
        with self._flushing:  # one flush at a time (the thread's and the end of run's)
            if buf.path.exists() and not buf.rows():  # only unreadable lines: set them aside
                with buf.lock:
                    buf.drop_first(0)
            try:
                while True:
                    with buf.lock:
                        rows = buf.rows()
                        if not rows:
                            self._outage.clear()
                            return True
                    replay_rows(self._client, rows)
                    with buf.lock:
                        if buf.drop_first(len(rows)) == 0:
                            self._outage.clear()
                            log.warning("MLflow server %s is back: the buffered metrics were sent", buf.tracking_uri)
                            return True
            except Exception as e:  # noqa: BLE001 - still down (or down again): keep the rows, retry later
                log.debug("flushing the MLflow buffer failed: %s", e)
                return False

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)


def install(logger, output_dir, max_bytes: int = MAX_BYTES) -> Optional[BufferedClient]:
    """Wrap an http(s) ``logger``'s MLflow client in a `BufferedClient` and set `SHORT_RETRIES`; else None."""
    uri = str(getattr(logger, "_tracking_uri", "") or "")
    if not uri.startswith(("http://", "https://")):
        return None
    for k, v in SHORT_RETRIES.items():
        os.environ.setdefault(k, v)
    client = BufferedClient(logger._mlflow_client, OutageBuffer(Path(output_dir) / BUFFER_FILE, uri, max_bytes))
    logger._mlflow_client = client
    return client


def flush_or_report(logger) -> None:
    """End of run: flush the buffered rows, or log one line naming the buffer and the command that imports it."""
    client = getattr(logger, "_mlflow_client", None)
    if not isinstance(client, BufferedClient):
        return
    client.close()
    buf = client._buffer
    if not client.in_outage or (server_answers(buf.tracking_uri) and client.flush()):
        return
    lost = f"; {buf.refused} writes were refused (buffer full at {buf.max_bytes >> 20} MiB)" if buf.refused else ""
    lost += f"; {buf.set_aside} unreadable lines are kept in {buf.aside_path}" if buf.set_aside else ""
    log.warning("MLflow server %s is unreachable: this run's metrics since the outage are in %s%s; import them once "
                "it is back: python -m fspo.tracking.replay %s --tracking-uri %s", buf.tracking_uri, buf.path, lost,
                shlex.quote(str(buf.path)), shlex.quote(buf.tracking_uri))
