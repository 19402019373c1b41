"""One run per output folder: an exclusive lock on ``<output_dir>/run.lock`` for the run's life.

The lock is a `filelock.FileLock`, re-entrant within one process (the Hydra callback `LockOutputDir` takes it
before Hydra writes into the folder, then ``train``); the kernel drops it when the holder dies in any way, so
a dead run never blocks a new one. The holder writes ``{"pid", "host", "started", "argv"}`` into the file and
empties it on a clean release: a second run names the holder in its error, and a record left while the lock
is free is a run that died, reported and taken over. Only the launching process (rank 0) takes the lock; on a
file system without ``flock`` the run goes on with a warning.
"""
from __future__ import annotations

import atexit
import contextlib
import errno
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterator, Optional

from filelock import FileLock, Timeout
from hydra.experimental.callback import Callback
from omegaconf import OmegaConf

log = logging.getLogger(__name__)
LOCK_FILE = "run.lock"
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
_held: Dict[str, FileLock] = {}  # resolved lock path -> this process's lock on it


class OutputDirInUse(ValueError):
    """Another live process holds the output folder's lock."""


def _read_holder(path: Path) -> Optional[Dict[str, Any]]:
    """The holder record in the lock file, None when missing, empty (a clean release) or unreadable."""
    try:
        raw = path.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return None
    if not raw:
        return None
    try:
        info = json.loads(raw)
    except ValueError:
        info = None
    return info if isinstance(info, dict) else {}


def _describe(info: Dict[str, Any]) -> str:
    return (f"pid {info.get('pid', '?')} on host {info.get('host', '?')}, started "
            f"{info.get('started', '?')}")


def acquire(output_dir) -> bool:
    """Take the lock of ``output_dir`` (created if missing); False when the file system has no locks.
    Raises `OutputDirInUse` naming the holder."""
    out = Path(output_dir).resolve()
    path = out / LOCK_FILE
    if str(path) in _held:
        _held[str(path)].acquire()
        return True
    out.mkdir(parents=True, exist_ok=True)
    before = _read_holder(path)  # read first: filelock may empty the file when it takes the lock
    lock = FileLock(str(path), timeout=0, thread_local=False)
    try:
        lock.acquire()
    except Timeout:
        holder = _read_holder(path) or before or {}
        raise OutputDirInUse(
            f"output_dir {out} is in use by another run ({_describe(holder)}; lock {path}): wait for it to "
            f"finish or stop it, or pass another output_dir") from None
    except (NotImplementedError, OSError) as e:
        if isinstance(e, OSError) and e.errno not in _NO_LOCKS:
            raise
        log.warning("cannot lock %s (%s): a second run in this output_dir would not be detected", path, e)
        return False
    if before is not None:
        log.warning("output_dir %s: the previous run (%s) ended without releasing its lock (killed?); taking it over",
                    out, _describe(before))
    me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
          "argv": " ".join(sys.argv)[:2000]}
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(json.dumps(me) + "\n")
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:  # a full or read-only disk: let go of the lock, or this process's next try says "in use"
        lock.release(force=True)
        raise OSError(e.errno, e.strerror, str(path)) from None  # named in the one-line error
    if not _held:
        atexit.unregister(_release_at_exit)  # registered once
        atexit.register(_release_at_exit)
    _held[str(path)] = lock
    return True


def _release_at_exit() -> None:
    """At interpreter exit every lock still held is released cleanly: only a killed run leaves its record."""
    for key in list(_held):
        release(Path(key).parent, force=True)


def release(output_dir, force: bool = False) -> None:
    """Drop one reference (all with ``force``) to this process's lock; the last one empties the file."""
    key = str(Path(output_dir).resolve() / LOCK_FILE)
    lock = _held.get(key)
    if lock is None:
        return
    if force or lock.lock_counter <= 1:
        del _held[key]
        with contextlib.suppress(OSError):
            os.truncate(key, 0)
    lock.release(force=force)


@contextlib.contextmanager
def hold_output_dir(output_dir, owner: bool = True) -> Iterator[None]:
    """Hold the lock of ``output_dir`` inside the block; ``owner=False`` (ranks other than 0) takes nothing."""
    held = acquire(output_dir) if owner else False
    try:
        yield
    finally:
        if held:
            release(output_dir)


def _run_dir(config) -> Optional[str]:
    try:
        return OmegaConf.select(config, "output_dir") or OmegaConf.select(config, "hydra.run.dir")
    except Exception:  # noqa: BLE001 - an interpolation that cannot resolve yet: train() locks later
        return None


class LockOutputDir(Callback):
    """Hydra callback: hold the output folder's lock from ``on_run_start`` to ``on_run_end``; a folder in use
    ends the command with one line and exit code 2. Multirun jobs are locked by ``train`` itself."""

    def __init__(self) -> None:
        self._dir: Optional[str] = None

    def on_run_start(self, config, **kwargs: Any) -> None:
        from fspo.runtime.launch.rank_zero import launch_rank

        d = _run_dir(config)
        if d is None or launch_rank() != 0:
            return
        try:
            if acquire(d):
                self._dir = d
        except OutputDirInUse as e:
            print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
            sys.exit(2)

    def on_run_end(self, config, **kwargs: Any) -> None:
        if self._dir is not None:
            release(self._dir)
            self._dir = None
