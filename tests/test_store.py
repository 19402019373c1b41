"""The MLflow store and the run's folders at start-up: storage failures are one line, fast, and lose nothing;
nothing is left bricked (fspo/runtime/checks/store_check.py).

Owns:
- a read-only existing store, a new SQLite store in a read-only folder (no rounds of MLflow retries), a full
  disk at start, a full disk in the middle of a run, a tracking URI that is a plain web server: each failure is
  one line naming the store or file and the fix, within seconds (bounded at `FAST_S` = 30 s), before a model
  loads where it can be known at start;
- messages: MLflow's logged traceback of a full SQLite store is dropped from the console (the error is raised
  on and reported as one line; other SQL errors are still logged), and a read-only artifact folder's message
  names overrides that the config accepts (``+logger.artifact_location`` with a new
  ``logger.experiment_name``: an experiment keeps the folder it was created with);
- creation: several processes creating one fresh SQLite store at once (no schema race), a SIGINT at spread-out
  moments of a fresh store's creation (each time the next open succeeds and the store is complete, at MLflow's
  head revision), a half-created store (no runs: moved aside and created again; with runs: one line,
  untouched), two sweeps started together on one fresh store (both exit 0, each under its own parent run, in
  their own default sweep folders);
- default run folders: two launches in the same second get two folders; the ranks of one torchrun launch
  share one.

How the conditions are made: read-only is a read-only bind mount when running as root (root ignores
permission bits) and ``chmod 555`` otherwise; a full disk is a small tmpfs filled to the brim, which
needs root's mount (those tests skip elsewhere), plus unit tests that need no privileges: a real
SQLITE_FULL error from ``PRAGMA max_page_count``, an ENOSPC raised by a monkeypatched probe write
and the exception chain the mid-run failure produced. Leaves out: checkpoint integrity
(test_resume.py), an http server that does not answer (test_numerics_guard.py) and the sweep configs
(test_sweeps.py).
"""
from __future__ import annotations

import errno
import json
import logging
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer, SimpleHTTPRequestHandler
from pathlib import Path

import pytest
from sqlalchemy.exc import IntegrityError, OperationalError

from conftest import REPO, SMALL, compose_config
from fspo.runtime.checks import store_check
from fspo.runtime.checks.console import quiet_third_party
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
            # its __context__ is the point
            raise MlflowException("(sqlite3.OperationalError) database or disk is full")  # noqa: B904
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
    """Three runs on one fresh SQLite store all start: no ``table _alembic_tmp_experiments already exists``
    from two schema migrations at once."""
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


def test_mlflow_s_traceback_of_a_full_store_is_not_printed(caplog):
    quiet_third_party()
    log = logging.getLogger("mlflow.store.db.utils")
    full = OperationalError("INSERT INTO metrics", {}, sqlite3.OperationalError("database or disk is full"))
    other = IntegrityError("INSERT INTO metrics", {}, sqlite3.IntegrityError("UNIQUE constraint failed"))
    with caplog.at_level(logging.ERROR, logger="mlflow.store.db.utils"):
        for exc in (full, other):
            try:
                raise exc
            except Exception:  # noqa: BLE001 - logged as MLflow does
                log.exception("SQLAlchemy database error. The following exception is caught.")
    assert [r.exc_info[1] for r in caplog.records] == [other]


def test_a_read_only_artifact_folder_names_overrides_that_exist(tmp_path, monkeypatch):
    art = tmp_path / "art"
    real = store_check._write_probe

    def probe(path: Path):
        if art in Path(path).parents or Path(path).parent == tmp_path:
            raise OSError(errno.EROFS, "Read-only file system")
        return real(path)

    monkeypatch.setattr(store_check, "_write_probe", probe)
    (tmp_path / "db").mkdir()
    with pytest.raises(StoreError) as e:
        prepare_store(f"sqlite:///{tmp_path / 'db' / 'm.db'}", "exp", str(art))
    msg = str(e.value)
    assert "read-only file system" in msg and "+logger.artifact_location=" in msg and "logger.experiment_name=" in msg
    compose_config(["logger.experiment_name=new", f"+logger.artifact_location={tmp_path}"])  # what it says works


CREATE = """
import sys, time
from fspo.runtime.checks.store_check import prepare_store
print("go", flush=True)
t0 = time.monotonic()
prepare_store(sys.argv[1], "exp")
print(f"took {time.monotonic() - t0:.3f}", flush=True)
"""


def _env():
    return {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}


def _start_create(db: Path) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", CREATE, f"sqlite:///{db}"], cwd=db.parent, env=_env(),
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert p.stdout.readline().strip() == "go"  # imports done: the clock starts at prepare_store
    return p


def _complete(db: Path) -> bool:
    from fspo.runtime.checks.sqlite_store import _head_revision, store_state

    s = store_state(db)
    return s["version"] == _head_revision() and not s["tmp_tables"]


@pytest.mark.slow
def test_sigint_at_any_moment_of_store_creation_leaves_a_usable_store(tmp_path):
    from fspo.runtime.checks.store_check import prepare_store

    probe = _start_create(tmp_path / "probe.db")  # how long creation takes on this machine, now
    took = float(probe.stdout.readline().split()[1])
    probe.wait(60)
    for i, frac in enumerate((0.05, 0.25, 0.45, 0.65, 0.85)):
        d = tmp_path / f"s{i}"
        d.mkdir()
        db = d / "m.db"
        p = _start_create(db)
        time.sleep(frac * took)
        p.send_signal(signal.SIGINT)
        p.wait(60)
        assert not db.exists() or _complete(db), f"SIGINT at {frac:.0%} of {took:.2f} s left a broken store"
        prepare_store(f"sqlite:///{db}", "exp")  # the next run opens it
        assert _complete(db)
        assert not list(d.glob(".m.db.creating-*"))


def _half_created(db: Path, runs: bool) -> None:
    from fspo.runtime.checks.store_check import prepare_store

    prepare_store(f"sqlite:///{db}", "exp" if runs else None)
    with sqlite3.connect(db) as con:
        if runs:
            con.execute("INSERT INTO runs (run_uuid, experiment_id, lifecycle_stage, status) "
                        "VALUES ('r1', 1, 'active', 'FINISHED')")
        con.execute("UPDATE alembic_version SET version_num='0c779009ac13'")
        con.execute("CREATE TABLE _alembic_tmp_experiments (x INTEGER)")


@pytest.mark.slow  # > 2.5 s: out of the quick loop (-m "not slow"), still in CI
def test_half_created_store_without_runs_is_moved_aside_and_created_again(tmp_path, caplog):
    from fspo.runtime.checks.store_check import prepare_store

    db = tmp_path / "m.db"
    _half_created(db, runs=False)
    prepare_store(f"sqlite:///{db}", "exp")
    assert _complete(db)
    aside = list(tmp_path.glob("m.db.interrupted-*"))
    assert len(aside) == 1 and "moved to" in caplog.text


@pytest.mark.slow  # > 2.5 s: out of the quick loop (-m "not slow"), still in CI
def test_half_migrated_store_with_runs_is_refused_and_untouched(tmp_path):
    from fspo.runtime.checks.errors import user_error
    from fspo.runtime.checks.sqlite_store import HalfMigratedStore
    from fspo.runtime.checks.store_check import prepare_store

    db = tmp_path / "m.db"
    _half_created(db, runs=True)
    before = db.read_bytes()
    with pytest.raises(HalfMigratedStore) as e:
        prepare_store(f"sqlite:///{db}", "exp")
    msg = user_error(e.value)
    assert "\n" not in msg and "_alembic_tmp_experiments" in msg and "mlflow db upgrade" in msg and str(db) in msg
    assert db.read_bytes() == before


@pytest.mark.slow
def test_two_sweeps_started_together_on_a_fresh_store_both_finish(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/m.db"
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "FSPO_MLFLOW_PARENT_RUN_ID",
                                                            "HYDRA_FULL_ERROR")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", HF_HUB_OFFLINE="1")
    cmd = [sys.executable, str(REPO / "experiments" / "run.py"), "-m", "--config-dir", str(REPO / "sweeps"),
           "--config-name", "methods", "+method=fspo", "seed=1", *[o for o in SMALL if not o.startswith("steps")],
           "steps=1", "val.size=0", f"logger.tracking_uri={uri}",
           f"+logger.artifact_location={tmp_path / 'artifacts'}"]
    procs = [subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("methods").experiment_id])
    parents = {r.info.run_id for r in runs if r.data.tags.get("fspo.role") == "sweep_parent"}
    jobs = [r for r in runs if r.info.run_id not in parents]
    assert len(parents) == 2 and len(jobs) == 2
    assert {r.data.tags["mlflow.parentRunId"] for r in jobs} == parents
    assert all(r.info.status == "FINISHED" for r in runs)
    assert len(list((tmp_path / "multirun" / "methods").iterdir())) == 2  # two sweep folders


def test_default_run_folders_are_unique_per_launch(tmp_path):
    cmd = [sys.executable, str(REPO / "experiments" / "run.py"), "--cfg", "hydra", "--resolve", "-p", "hydra.run.dir"]
    procs = [subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    dirs = [p.communicate(timeout=300)[0].strip().splitlines()[-1] for p in procs]
    assert dirs[0] != dirs[1] and all(d.startswith("outputs/") for d in dirs), dirs


def test_ranks_of_one_launch_share_the_folder_id(monkeypatch):
    import fspo.cli as cli

    for env, want in (({"SLURM_JOB_ID": "77"}, "j77"), ({"TORCHELASTIC_RUN_ID": "abc", "LOCAL_RANK": "1"}, "abc"),
                      ({"TORCHELASTIC_RUN_ID": "none", "LOCAL_RANK": "1"}, f"p{os.getppid()}")):
        for k in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "LOCAL_RANK"):
            monkeypatch.delenv(k, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        monkeypatch.setattr(cli, "_LAUNCH_ID", [])
        assert cli.launch_id() == want and cli.launch_id() == want
