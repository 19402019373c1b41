"""Storage failures are one line, fast, and lose nothing (fspo/runtime/checks/store_check.py).

Owns: a read-only existing store, a new SQLite store in a read-only folder (was 100 s of MLflow
retries), a full disk at start, a full disk in the middle of a run, a tracking URI that is a plain web
server, and several runs creating one fresh SQLite store at once (was a schema race). Each failure is
one line naming the store or file and the fix, within seconds (bounded at `FAST_S` = 30 s),
before a model loads where it can be known at start.

How the conditions are made: read-only is a read-only bind mount when running as root (root ignores
permission bits) and ``chmod 555`` otherwise; a full disk is a small tmpfs filled to the brim, which
needs root's mount (those tests skip elsewhere), plus unit tests that need no privileges: a real
SQLITE_FULL error from ``PRAGMA max_page_count``, an ENOSPC raised by a monkeypatched probe write
and the exception chain the mid-run failure produced. Leaves out: checkpoint integrity
(test_resume.py) and an http server that does not answer (test_numerics_guard.py).
"""
from __future__ import annotations

import errno
import json
import os
import sqlite3
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer, SimpleHTTPRequestHandler
from pathlib import Path

import pytest

from conftest import REPO, SMALL, compose_config
from fspo.runtime.checks.errors import user_error
from fspo.runtime.checks.store_check import NotAnMLflowServer, StoreError, check_writable, prepare_store, storage_error

FAST_S = 30  # the promised bound; these take well under 5 s after the imports


def _mount(*args) -> bool:
    return subprocess.run(["mount", *args], capture_output=True).returncode == 0


@pytest.fixture
def readonly():
    """``make(folder)`` -> a read-only view of ``folder`` (see the module docstring)."""
    mounted, chmodded = [], []

    def make(folder: Path) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        if os.geteuid() != 0:
            folder.chmod(0o555)
            chmodded.append(folder)
            return folder
        view = folder.with_name(folder.name + "_ro")
        view.mkdir()
        if not _mount("--bind", str(folder), str(view)):
            pytest.skip("root without mount permission: cannot make a read-only folder")
        mounted.append(view)
        if not _mount("-o", "remount,bind,ro", str(view)):
            pytest.skip("cannot remount read-only")
        return view

    yield make
    for m in mounted:
        subprocess.run(["umount", "-l", str(m)], capture_output=True)
    for f in chmodded:
        f.chmod(0o755)


@pytest.fixture
def tmpfs():
    """``make(folder, mib)`` -> ``folder`` as a tmpfs of ``mib`` MiB (root only, else the test skips)."""
    mounted = []

    def make(folder: Path, mib: int) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        if os.geteuid() != 0 or not _mount("-t", "tmpfs", "-o", f"size={mib}M", "tmpfs", str(folder)):
            pytest.skip("needs root's mount for a small tmpfs")
        mounted.append(folder)
        return folder

    yield make
    for m in mounted:  # lazily: the MLflow client of this process may still hold the store open
        subprocess.run(["umount", "-l", str(m)], capture_output=True)


def fill(folder: Path, leave_bytes: int = 0) -> None:
    """Fill ``folder``'s file system, leaving about ``leave_bytes`` free."""
    free = os.statvfs(folder).f_bavail * os.statvfs(folder).f_frsize
    with open(folder / "filler", "wb") as f:
        try:
            f.write(b"\0" * max(free - leave_bytes, 0))
            f.flush()
        except OSError:
            pass


def new_store(folder: Path) -> str:
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    prepare_store(uri, "made")
    return uri


def timed(fn, *a, **kw):
    t0 = time.monotonic()
    try:
        fn(*a, **kw)
    except Exception as e:  # noqa: BLE001 - returned for the caller to check
        return e, time.monotonic() - t0
    return None, time.monotonic() - t0


@pytest.mark.slow  # > 2.5 s: out of the quick loop (-m "not slow"), still in CI
def test_readonly_existing_store(tmp_path, readonly):
    uri = new_store(tmp_path / "store")
    ro = readonly(tmp_path / "store")
    err, took = timed(prepare_store, f"sqlite:///{ro / 'mlflow.db'}", "fspo")
    assert isinstance(err, StoreError) and took < FAST_S
    line = user_error(err)
    assert "\n" not in line and str(ro) in line and "logger.tracking_uri" in line, line
    assert "read-only" in line or "permission denied" in line, line
    assert uri  # the store itself is untouched (it was only read)


def test_new_store_in_readonly_folder_fails_in_seconds(tmp_path, readonly):
    ro = readonly(tmp_path / "empty")
    err, took = timed(prepare_store, f"sqlite:///{ro / 'new.db'}", "fspo")
    assert isinstance(err, StoreError) and took < 5, (err, took)  # MLflow alone: ~100 s of retries
    assert str(ro) in str(err) and "logger.tracking_uri" in str(err)


def test_readonly_output_dir_is_one_line(tmp_path, readonly, compose_cfg, monkeypatch):
    import fspo.train as ft

    ro = readonly(tmp_path / "outs")
    monkeypatch.setattr(ft, "load_policy", lambda **_: pytest.fail("model loaded before the output check"))
    cfg = compose_cfg([*SMALL])
    cfg.output_dir = str(ro / "run")
    err, took = timed(ft.train, cfg)
    line = user_error(err)
    assert line is not None and "\n" not in line and str(ro) in line and took < FAST_S, (err, line)


def test_full_disk_at_start_fails_before_the_model(tmp_path, tmpfs, monkeypatch):
    import fspo.train as ft

    disk = tmpfs(tmp_path / "disk", 8)
    uri = new_store(disk)
    fill(disk)
    monkeypatch.setattr(ft, "load_policy", lambda **_: pytest.fail("model loaded before the store check"))
    cfg = compose_config([*SMALL], output_dir=tmp_path / "out", tracking_uri=uri, artifact_location=tmp_path / "art")
    err, took = timed(ft.train, cfg)
    assert isinstance(err, StoreError) and took < FAST_S, err
    line = user_error(err)
    assert "disk full" in line and str(disk) in line and "\n" not in line, line


def test_full_disk_probe_without_privileges(tmp_path, monkeypatch):
    """The same start-up check with the disk made full by a monkeypatched probe write."""
    import fspo.runtime.checks.store_check as sc

    def full(path):
        path.touch()
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sc, "_write_probe", full)
    with pytest.raises(StoreError, match=r"output_dir .* cannot be written \(disk full\): free space on that file "
                                         r"system or point output_dir at another disk"):
        check_writable(tmp_path, "output_dir")
    assert list(tmp_path.iterdir()) == []  # the probe file is gone


@pytest.mark.slow  # a real run that fills its disk: ~20 s
def test_full_disk_mid_run_is_one_line_and_keeps_what_was_written(tmp_path, tmpfs):
    """Store and checkpoints on a 40 MiB tmpfs with room for one checkpoint of the tiny model (12 MB):
    the second checkpoint fills the disk."""
    from mlflow.tracking import MlflowClient

    from fspo.runtime.checkpoints.files import list_checkpoints
    from fspo.train import train

    disk = tmpfs(tmp_path / "disk", 40)
    uri = new_store(disk)
    fill(disk, leave_bytes=20 * 2**20)
    cfg = compose_config([*SMALL, "steps=5", "val.size=0", "checkpoint.every_n_steps=1"],
                         output_dir=disk / "out", tracking_uri=uri, artifact_location=tmp_path / "art")
    with pytest.raises(Exception) as e:
        train(cfg)
    line = user_error(e.value)
    assert line is not None and "\n" not in line, e.value
    assert "disk full" in line and "step_000002.ckpt" in line and "resume=auto" in line, line
    out = disk / "out"
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == ["step_000001.ckpt"]
    client = MlflowClient(uri)
    run_id = (out / "mlflow_run_id").read_text().strip()
    assert [m.step for m in client.get_metric_history(run_id, "train/loss")] == [0, 1]


def test_mid_run_exception_chain_names_the_first_failure():
    """The chain the mid-run full disk produced: the checkpoint move failed, then MLflow could not mark
    the run FAILED (SQLite full) while handling it."""
    from mlflow.exceptions import MlflowException

    first = OSError(errno.ENOSPC, "No space left on device", "/tmp/tmpab", None,
                    "/run/checkpoints/step_000002.ckpt.partial")
    try:
        try:
            raise first
        except OSError:
            raise MlflowException("(sqlite3.OperationalError) database or disk is full")  # noqa: B904 (its __context__ is the point)
    except MlflowException as last:
        line = storage_error(last)
    assert line.startswith("storage error (disk full) writing /run/checkpoints/step_000002.ckpt.partial"), line
    assert "point output_dir at another disk" in line and "resume=auto" in line


def test_real_sqlite_full_error_is_named(tmp_path):
    con = sqlite3.connect(str(tmp_path / "x.db"))
    con.execute("PRAGMA max_page_count = 2")
    with pytest.raises(sqlite3.OperationalError) as e:
        con.execute("CREATE TABLE t (x BLOB)")
        con.execute("INSERT INTO t VALUES (zeroblob(100000))")
        con.commit()
    line = user_error(e.value)
    assert line.startswith("storage error (disk full) writing the MLflow store") and "logger.tracking_uri" in line


class _Plain(SimpleHTTPRequestHandler):
    def log_message(self, *a):
        pass


class _FakeMLflow(BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"error_code": "RESOURCE_DOES_NOT_EXIST", "message": "no such experiment"}).encode()
        self.send_response(404)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


@pytest.fixture
def server():
    started = []

    def start(handler) -> str:
        srv = HTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        started.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}"

    yield start
    for s in started:
        s.shutdown()


def test_plain_web_server_is_not_an_mlflow_store(server):
    uri = server(_Plain)
    err, took = timed(prepare_store, uri, None)
    assert isinstance(err, NotAnMLflowServer) and took < 5
    line = user_error(err)
    assert uri in line and "not an MLflow tracking server" in line and "logger_fallback=local" in line, line


@pytest.mark.slow  # > 2.5 s: out of the quick loop (-m "not slow"), still in CI
def test_plain_web_server_falls_back_when_asked(server, tmp_path):
    from omegaconf import open_dict

    from fspo.runtime.checkpoints.resume import ResumePlan
    from fspo.tracking.logger import build_logger

    cfg = compose_config([*SMALL], output_dir=tmp_path)
    cfg.logger.tracking_uri = server(_Plain)
    with pytest.raises(NotAnMLflowServer):
        build_logger(cfg, {}, tmp_path, ResumePlan())
    with open_dict(cfg):
        cfg.logger_fallback = "local"
    [logger] = build_logger(cfg, {}, tmp_path, ResumePlan())  # the list of the run's loggers: MLflow only
    assert logger._tracking_uri == f"sqlite:///{(tmp_path / 'mlflow.db').resolve()}"


def test_mlflow_like_server_passes(server):
    prepare_store(server(_FakeMLflow), None)  # JSON from the REST API: an MLflow server


RACER = """
import sys, time
from mlflow.tracking import MlflowClient
from fspo.runtime.checks.store_check import prepare_store
uri, start = sys.argv[1], float(sys.argv[2])
time.sleep(max(0.0, start - time.time()))  # every process enters at the same moment
prepare_store(uri, "race")
c = MlflowClient(uri)
run = c.create_run(c.get_experiment_by_name("race").experiment_id)
c.log_metric(run.info.run_id, "x", 1.0)
print("ok")
"""


@pytest.mark.slow  # three processes importing MLflow: ~20 s on a loaded 2-core machine
def test_runs_creating_one_fresh_store_at_once(tmp_path):
    """Before: two runs on one fresh SQLite store failed with ``table _alembic_tmp_experiments already
    exists`` (2 of 2 trials)."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'fresh' / 'mlflow.db'}"
    start = time.time() + 12  # after the imports
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
    procs = [subprocess.Popen([sys.executable, "-c", RACER, uri, str(start)], env=env, cwd=str(REPO),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0 and out.strip() == "ok", err[-3000:]
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("race")
    assert len(client.search_runs([exp.experiment_id])) == 3
