"""Storage before and during a run: the MLflow store and output folder must take writes before anything starts.

At start-up every folder the run writes gets a 64 KiB probe file (written, fsynced, removed), so a read-only
file system, a missing permission or a full disk fails at once, named, not after MLflow's 100 s of retries;
an existing SQLite store must take ``BEGIN IMMEDIATE``; a missing one is created, and its experiment made,
under a lock on its folder (MLflow creates tables unlocked, so runs starting together would race); an http(s)
URI must answer as an MLflow server. During a run `storage_error` turns a failed write into one line naming
the file, the cause and the fix; nothing written before is touched.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import sqlite3
import time
import urllib.error
import urllib.parse
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, List, Optional

from fspo.runtime.checks.sqlite_store import ensure_sqlite_store

log = logging.getLogger(__name__)
PROBE_BYTES = 64 * 1024
LOCK_WAIT_S = 60.0


class StoreError(ValueError):
    """A store or folder the run must write cannot be written; the message names it, the cause and the fix."""


class NotAnMLflowServer(ValueError):
    """An http(s) tracking URI answers, but not as an MLflow tracking server."""


# cause -> (what happened, the fix; {key} is the setting that places the file)
_CAUSES = {
    errno.ENOSPC: ("disk full", "free space on that file system or point {key} at another disk"),
    errno.EDQUOT: ("disk quota exceeded", "free space within your quota or point {key} at another disk"),
    errno.EROFS: ("read-only file system", "point {key} at a writable location"),
    errno.EACCES: ("permission denied", "make it writable for this user or point {key} at a writable location"),
    errno.EPERM: ("permission denied", "make it writable for this user or point {key} at a writable location"),
}
_FREE = _CAUSES[errno.ENOSPC][1]
_MESSAGES = (  # text of errors that carry no errno: SQLite's (through SQLAlchemy / MLflow) and torch.save's
    ("database or disk is full", ("disk full", _FREE)),
    ("attempt to write a readonly database", ("read-only database", "make the store file writable or point "
                                              "{key} at a writable location")),
    ("unable to open database file", ("cannot open the database file", "make its folder exist and be writable "
                                      "or point {key} elsewhere")),
    ("disk I/O error", ("disk I/O error, often a full disk or a lost network mount", _FREE)),
    ("file write failed", ("write failed, usually a full disk", _FREE)),  # torch.save's PytorchStreamWriter
)
STORE_KEY = "logger.tracking_uri (or MLFLOW_TRACKING_URI)"


def check_writable(folder, what: str, key: str = "output_dir") -> None:
    """Raise `StoreError` unless ``folder`` (created if missing) takes a 64 KiB file; ``key`` places it."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".fspo-write-probe-{socket.gethostname()}-{os.getpid()}"  # unique on a shared disk
        try:
            _write_probe(probe)
        finally:
            probe.unlink(missing_ok=True)
    except OSError as e:
        cause, fix = _CAUSES.get(e.errno, (e.strerror or str(e), "point {key} at a writable location"))
        raise StoreError(f"{what} {folder} cannot be written ({cause}): {fix.format(key=key)}") from None


def _write_probe(path: Path) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, b"\0" * PROBE_BYTES)
        os.fsync(fd)
    finally:
        os.close(fd)


def _sqlite_path(uri: str) -> Optional[Path]:
    """The database file of a ``sqlite:`` URI, None for an in-memory database."""
    from sqlalchemy.engine import make_url

    db = make_url(uri).database
    return None if db in (None, "", ":memory:") else Path(db).expanduser().absolute()


@contextmanager
def folder_lock(folder: Path, wait_s: float = LOCK_WAIT_S) -> Iterator[None]:
    """An exclusive ``flock`` on ``folder`` itself (no lock file left behind); unlocked, with a warning, where
    the file system has no flock or after ``wait_s``."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        yield
        return
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    log.warning("%s stayed locked for %.0f s; opening the MLflow store without the lock", folder,
                                wait_s)
                    break
                time.sleep(0.1)
            except OSError as e:
                log.warning("cannot lock %s (%s); opening the MLflow store without the lock", folder, e)
                break
        yield
    finally:
        os.close(fd)  # releases the lock


def _check_sqlite_file(path: Path, uri: str) -> None:
    """An existing database must take a write transaction (a read-only file fails here)."""
    if not path.exists():
        return
    try:
        con = sqlite3.connect(str(path), timeout=10)
        try:
            con.execute("BEGIN IMMEDIATE")
            con.rollback()
        finally:
            con.close()
    except sqlite3.OperationalError as e:
        if "locked" in str(e):
            return  # another writer holds it; MLflow waits as usual
        raise StoreError(f"MLflow store {uri} cannot be written ({e}): make {path} writable or point "
                         f"{STORE_KEY} at a writable location") from None


def check_mlflow_server(uri: str, timeout_s: float = 5.0) -> None:
    """Raise `NotAnMLflowServer` unless ``uri`` answers MLflow's REST API with JSON or an auth challenge."""
    url = uri.rstrip("/") + "/api/2.0/mlflow/experiments/get-by-name?experiment_name=" + \
        urllib.parse.quote("fspo-store-probe")
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            status, ctype, body = r.status, r.headers.get("Content-Type", ""), r.read(4096)
    except urllib.error.HTTPError as e:
        status, ctype, body = e.code, e.headers.get("Content-Type", "") if e.headers else "", e.read(4096)
    except (urllib.error.URLError, OSError):
        return  # not answering at all is check_tracking_uri's case
    if status in (401, 403, 407):
        return
    try:
        ok = isinstance(json.loads(body.decode("utf-8", "replace")), dict)
    except ValueError:
        ok = False
    if not ok:
        raise NotAnMLflowServer(
            f"{uri} answers HTTP but is not an MLflow tracking server (GET /api/2.0/mlflow/experiments/get-by-name "
            f"gave {status} {ctype.split(';')[0] or 'without a content type'}): point logger.tracking_uri (or "
            f"MLFLOW_TRACKING_URI) at `mlflow server`'s address, or set logger_fallback=local")


def ensure_experiment(uri: str, name: str, artifact_location: Optional[str]):
    """The active experiment ``name`` at ``uri``, created if missing; None when it exists only as deleted."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(name)
    if exp is None:
        try:
            client.create_experiment(name, artifact_location=artifact_location)
        except MlflowException as e:
            if "already exists" not in str(e) and "UNIQUE" not in str(e):
                raise
        exp = client.get_experiment_by_name(name)
    return exp if exp is not None and exp.lifecycle_stage == "active" else None


def _local_path(location: Optional[str]) -> Optional[Path]:
    """The local folder of an artifact location (a plain path or file: URI), None for remote ones."""
    if not location:
        return None
    parsed = urllib.parse.urlparse(str(location))
    if parsed.scheme == "file":
        return Path(urllib.parse.unquote(parsed.path))
    return Path(location) if parsed.scheme == "" else None


def _nearest_existing(p: Path) -> Path:
    p = p.absolute()
    while not p.exists() and p.parent != p:
        p = p.parent
    return p


def prepare_store(uri: Optional[str], experiment_name: Optional[str] = None,
                  artifact_location: Optional[str] = None) -> None:
    """Check and open the MLflow store at ``uri`` before the run; `StoreError` / `NotAnMLflowServer` if not fit."""
    if not uri:
        return
    scheme = urllib.parse.urlparse(str(uri)).scheme
    if scheme in ("http", "https"):
        check_mlflow_server(str(uri))
    elif scheme == "sqlite":
        path = _sqlite_path(str(uri))
        if path is not None:
            check_writable(path.parent, f"the folder of the MLflow store {uri}", STORE_KEY)
            _check_sqlite_file(path, str(uri))
            with folder_lock(path.parent):
                ensure_sqlite_store(path, str(uri))  # created atomically; an interrupted creation repaired
                exp = ensure_experiment(str(uri), experiment_name, artifact_location) if experiment_name else None
            _check_artifacts(exp, artifact_location)
            return
    elif scheme in ("", "file"):
        check_writable(_local_path(str(uri)), "the MLflow file store", STORE_KEY)
    else:  # databricks, ...: left to MLflow
        return
    if experiment_name:
        _check_artifacts(ensure_experiment(str(uri), experiment_name, artifact_location), artifact_location)


def _check_artifacts(exp, artifact_location: Optional[str]) -> None:
    """The experiment's local artifact folder (plots and the config go there at the end) must be writable."""
    local = _local_path(getattr(exp, "artifact_location", None) or artifact_location)
    if local is not None:  # an experiment keeps the folder it was created with: a new one needs a new experiment
        check_writable(_nearest_existing(local), f"the MLflow artifact folder of {local}:",
                       "a new experiment (logger.experiment_name=<new name> +logger.artifact_location=<folder>)")


def _chain(exc: BaseException) -> List[BaseException]:
    """``exc`` and every exception it was raised from or while handling (not hidden by ``from None``)."""
    out: List[BaseException] = []
    stack = [exc]
    while stack:
        e = stack.pop()
        if e is None or any(e is o for o in out):
            continue
        out.append(e)
        stack.extend([None if e.__suppress_context__ else e.__context__, e.__cause__])
    return out


def _classify(e: BaseException):
    """((cause, fix), the file or None) for a storage failure, else None."""
    if isinstance(e, (StoreError, NotAnMLflowServer)):  # already one line
        return None
    if isinstance(e, OSError) and e.errno in _CAUSES:
        return _CAUSES[e.errno], e.filename2 or e.filename or ""  # a move or copy fails at its target
    text = str(e)
    for needle, cause in _MESSAGES:
        if needle in text:
            return cause, "torch.save" if needle == "file write failed" else None
    return None


def storage_error(exc: BaseException) -> Optional[str]:
    """One line for the earliest storage failure in ``exc``'s chain (the file, the cause, the fix), else None."""
    found = [(e, c) for e in _chain(exc) if (c := _classify(e)) is not None]
    if not found:
        return None
    e, ((cause, fix), where) = found[-1]
    key = "output_dir"
    if where is None:
        target, key = "the MLflow store", STORE_KEY
    elif where == "torch.save":
        target = "a checkpoint"
    else:
        target = str(where) or "a file of the run"
    detail = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return (f"storage error ({cause}) writing {target} [{detail}]: {fix.format(key=key)}, then continue with "
            f"resume=auto; what was written before (complete checkpoints, logged metrics) is kept")
