"""One run per output folder: an exclusive OS lock on ``<output_dir>/run.lock`` for the run's life.

Owns: `hold_output_dir` (the context manager `fspo.train.train` runs inside), `OutputDirInUse`
(raised when another live process holds the folder) and `LockOutputDir` (a Hydra callback, in
conf/config.yaml, that takes the same lock in ``on_run_start``, before Hydra writes ``.hydra/`` and
``run.log`` into the folder, so a second run touches nothing). Leaves out: what the run writes
there (fspo/runtime/checkpoints/checkpointing.py, fspo/runtime/checkpoints/resume.py).

Contract:
- the lock is ``fcntl.flock(LOCK_EX | LOCK_NB)`` on ``run.lock``; the kernel drops it when the
  holding process ends in any way (exit, exception, SIGKILL, OOM), so a dead run never blocks a
  new one. A clean release empties the file; a file still naming a holder when the lock is free
  is the stale record of a run that died, which is reported and taken over;
- the holder writes ``{"pid", "host", "started", "argv"}`` (JSON) into the file; a second run
  reads it for its error message, which names the folder, the holder and the fix;
- the lock is re-entrant within one process (the Hydra callback and ``train`` both take it;
  a reference count releases it after the last holder) and is taken by the launching process
  only: under torchrun / SLURM / Lightning's launcher the ranks other than 0 (`fspo.runtime.launch.rank_zero.
  launch_rank`) share their rank 0's lock and do not take one;
- on a file system without ``flock`` support the run goes on with a warning (no detection).
"""
from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterator, Optional

log = logging.getLogger(__name__)
LOCK_FILE = "run.lock"
_held: Dict[str, list] = {}  # resolved lock path -> [fd, reference count]


class OutputDirInUse(ValueError):
    """Another live process holds the output folder's lock."""


def _describe(info: Dict[str, Any]) -> str:
    return (f"pid {info.get('pid', '?')} on host {info.get('host', '?')}, started "
            f"{info.get('started', '?')}")


def _read_holder(fd: int) -> Optional[Dict[str, Any]]:
    """The holder record in the lock file, None when empty (a clean release) or unreadable."""
    try:
        raw = os.pread(fd, 65536, 0).decode("utf-8", "replace").strip()
    except OSError:
        return None
    if not raw:
        return None
    try:
        info = json.loads(raw)
    except ValueError:
        return {"pid": "?", "host": "?", "started": "?"}
    return info if isinstance(info, dict) else {"pid": "?", "host": "?", "started": "?"}


def acquire(output_dir) -> bool:
    """Take the lock of ``output_dir`` (created if missing) for this process; True when held
    (False: the file system does not support locks). Raises `OutputDirInUse` naming the holder."""
    out = Path(output_dir).resolve()
    key = str(out / LOCK_FILE)
    if key in _held:
        _held[key][1] += 1
        return True
    out.mkdir(parents=True, exist_ok=True)
    fd = os.open(key, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read_holder(fd) or {}
        os.close(fd)
        raise OutputDirInUse(
            f"output_dir {out} is in use by another run ({_describe(holder)}; lock {key}): wait for it to "
            f"finish or stop it, or pass another output_dir") from None
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            log.warning("cannot lock %s (%s): a second run in this output_dir would not be detected", key, e)
            return False
        raise
    stale = _read_holder(fd)
    if stale:
        log.warning("output_dir %s: the previous run (%s) ended without releasing its lock (killed?); taking it over",
                    out, _describe(stale))
    me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
          "argv": " ".join(sys.argv)[:2000]}
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        os.fsync(fd)
    except OSError as e:  # a full or read-only disk: let go of the lock, or this process's next try says "in use"
        os.close(fd)
        raise OSError(e.errno, e.strerror, key) from None  # named: fspo/runtime/checks/errors.py makes it one line
    if not _held:
        atexit.unregister(_release_at_exit)  # registered once
        atexit.register(_release_at_exit)
    _held[key] = [fd, 1]
    return True


def _release_at_exit() -> None:
    """At interpreter exit (a clean end, an error, a stop signal's SystemExit, Ctrl-C; not SIGKILL) every lock
    still held is released cleanly, even when Hydra's ``on_run_end`` was skipped by the exception: only a run
    that was killed leaves its record for the next one to report."""
    for key in list(_held):
        _held[key][1] = 1
        release(Path(key).parent)


def release(output_dir) -> None:
    """Drop one reference to this process's lock of ``output_dir``; the last one empties the file
    (a clean end) and unlocks it. No-op when not held."""
    key = str(Path(output_dir).resolve() / LOCK_FILE)
    entry = _held.get(key)
    if entry is None:
        return
    entry[1] -= 1
    if entry[1] > 0:
        return
    fd = _held.pop(key)[0]
    try:
        os.ftruncate(fd, 0)
    except OSError:
        pass
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


@contextlib.contextmanager
def hold_output_dir(output_dir, owner: bool = True) -> Iterator[None]:
    """Hold the lock of ``output_dir`` inside the block (released on any exit from it); ``owner=False``
    (ranks other than 0) takes nothing."""
    held = acquire(output_dir) if owner else False
    try:
        yield
    finally:
        if held:
            release(output_dir)


def _run_dir(config) -> Optional[str]:
    from omegaconf import OmegaConf

    try:
        return OmegaConf.select(config, "output_dir") or OmegaConf.select(config, "hydra.run.dir")
    except Exception:  # noqa: BLE001 - an interpolation that cannot resolve yet: train() locks later
        return None


try:
    from hydra.experimental.callback import Callback as _HydraCallback
except ImportError:  # pragma: no cover - hydra is a dependency
    _HydraCallback = object


class LockOutputDir(_HydraCallback):
    """Hydra callback: take the output folder's lock in ``on_run_start`` (before Hydra writes into
    the folder) and drop it in ``on_run_end``. A folder in use ends the command with one line and
    exit code 2. Multirun jobs are locked by ``train`` itself (each job has its own folder)."""

    def __init__(self) -> None:
        self._dir: Optional[str] = None

    def on_run_start(self, config, **kwargs: Any) -> None:
        """Lock ``output_dir`` (or ``hydra.run.dir``) on the launching process."""
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
        """Release the lock taken in `on_run_start`."""
        if self._dir is not None:
            release(self._dir)
            self._dir = None
