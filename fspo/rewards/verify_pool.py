"""Worker processes that run equivalence checks under a hard per-check deadline: math-verify's own timeouts cannot
interrupt C-level work (``verify`` on ``2^{2^{2^{100}}}`` never returns), so a worker that overruns ``timeout_s`` is
SIGKILLed. One *zygote* warms math-verify once and forks workers on request (a replacement costs a fork); workers
talk JSON lines, run under an address-space limit (``memory_mb``) and die with the zygote, which exits when the
parent's control socket closes.
"""
from __future__ import annotations

import ctypes
import functools
import importlib
import json
import logging
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from contextlib import suppress
from multiprocessing.connection import wait
from typing import Callable, List, Optional, Sequence, Tuple

DEFAULT_CHECK = "fspo.rewards.verify_pool:math_verify_equal"
START_TIMEOUT_S = 60.0
_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@functools.lru_cache(maxsize=8192)
def _parse_gold(gold: str):
    from math_verify import parse

    return parse("\\boxed{" + gold + "}", parsing_timeout=None)


def math_verify_equal(pred: str, gold: str) -> bool:
    """math-verify equivalence of an extracted answer and a reference, each wrapped in ``\\boxed{}`` and read by
    math-verify's parser (no eval/exec/sympify); its signal timeouts are off: the `VerifyPool` deadline rules."""
    from math_verify import parse, verify

    return bool(verify(_parse_gold(gold), parse("\\boxed{" + pred + "}", parsing_timeout=None),
                       timeout_seconds=None))


def load_check(spec: str) -> Callable[[str, str], bool]:
    """``"package.module:function"`` -> the function."""
    mod, _, fn = spec.partition(":")
    if not mod or not fn:
        raise ValueError(f"check must look like 'package.module:function', got {spec!r}")
    return getattr(importlib.import_module(mod), fn)


def _die_with_parent() -> None:
    with suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _serve(sock: socket.socket, check: Callable[[str, str], bool], memory_mb: int) -> None:
    """Worker loop: one JSON request per line -> one JSON reply per line; exits at EOF."""
    _die_with_parent()
    if memory_mb > 0:
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    for line in sock.makefile("rb"):
        tid, pred, gold = json.loads(line)
        try:
            reply = [tid, "ok", bool(check(pred, gold))]
        except BaseException as e:  # noqa: BLE001 - report, never die on a bad input
            reply = [tid, "error", f"{type(e).__name__}: {str(e)[:200]}"]
        sock.sendall((json.dumps(reply) + "\n").encode("utf-8"))


def _zygote_main(fd: int, spec: str, memory_mb: int) -> None:
    # no PDEATHSIG (it fires when the *thread* that started us exits): exit at the control socket's EOF
    sys.stdout = sys.stderr
    logging.disable(logging.CRITICAL)
    ctl = socket.socket(fileno=fd)
    check = load_check(spec)
    with suppress(Exception):
        check("1", "1")  # warm lazy imports once; every forked worker inherits them
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # workers are reaped automatically
    ctl.sendall(b"ready\n")
    while True:
        msg, fds, _, _ = socket.recv_fds(ctl, 16, 1)
        if not msg or not fds:
            os._exit(0)
        pid = os.fork()
        if pid == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            ctl.close()
            try:
                _serve(socket.socket(fileno=fds[0]), check, memory_mb)
            finally:
                os._exit(0)
        os.close(fds[0])
        ctl.sendall(f"{pid}\n".encode())


class _Worker:
    def __init__(self, sock: socket.socket, pid: int):
        self.sock, self.pid, self.buf = sock, pid, b""
        self.task: Optional[Tuple[int, float]] = None  # (task index, deadline)

    def fileno(self) -> int:
        return self.sock.fileno()

    def read_lines(self) -> Optional[List[list]]:
        """Complete JSON lines available now; None at EOF (the worker died)."""
        chunk = self.sock.recv(1 << 16)
        if not chunk:
            return None
        *lines, self.buf = (self.buf + chunk).split(b"\n")
        return [json.loads(x) for x in lines if x.strip()]

    def kill(self) -> None:
        with suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        self.sock.close()


class VerifyPool:
    """``num_workers`` processes running ``check(pred, gold) -> bool`` (``"module:function"``). `run` maps
    (pred, gold) pairs to ("ok", bool) | ("error", message) | ("timeout", None) in input order, each check
    given ``timeout_s`` of wall time after dispatch; started lazily, one thread at a time."""

    def __init__(self, num_workers: int = 2, timeout_s: float = 1.0, memory_mb: int = 2048,
                 check: str = DEFAULT_CHECK):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        load_check(check)  # fail fast on a bad spec, in the parent
        self.num_workers, self.timeout_s, self.memory_mb, self.check = num_workers, float(timeout_s), memory_mb, check
        self.workers: List[_Worker] = []
        self.restarts = 0
        self._zygote: Optional[subprocess.Popen] = None
        self._ctl: Optional[socket.socket] = None

    def _start_zygote(self) -> None:
        ours, theirs = socket.socketpair()
        env = dict(os.environ)  # the package stays importable even when it is not installed
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_PARENT, env.get("PYTHONPATH")) if p)
        self._zygote = subprocess.Popen(
            [sys.executable, "-m", "fspo.rewards.verify_pool", str(theirs.fileno()), self.check, str(self.memory_mb)],
            pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL)
        theirs.close()
        self._ctl, self._ctl_lines = ours, ours.makefile("rb")  # one reply outstanding at a time
        if not wait([ours], timeout=START_TIMEOUT_S) or self._readline() != "ready":
            self.close()
            raise RuntimeError(f"verification zygote did not start within {START_TIMEOUT_S:.0f}s "
                               f"(check {self.check!r}; see its stderr above)")

    def _readline(self) -> str:
        return self._ctl_lines.readline().decode().strip()

    def _fork_worker(self) -> _Worker:
        if self._zygote is None or self._zygote.poll() is not None:
            self._start_zygote()
        ours, theirs = socket.socketpair()
        socket.send_fds(self._ctl, [b"S"], [theirs.fileno()])
        theirs.close()
        return _Worker(ours, int(self._readline()))

    def start(self) -> None:
        """Start the zygote and the workers (idempotent)."""
        while len(self.workers) < self.num_workers:
            self.workers.append(self._fork_worker())

    def _replace(self, k: int) -> None:
        self.workers[k].kill()
        self.workers[k] = self._fork_worker()
        self.restarts += 1

    def run(self, tasks: Sequence[Tuple[str, str]]) -> List[Tuple[str, object]]:
        """Results for ``tasks`` in order (see the class docstring)."""
        if not tasks:
            return []
        self.start()
        results: dict = {}
        pending = deque(range(len(tasks)))
        while pending or any(w.task for w in self.workers):
            for k, w in enumerate(self.workers):
                if w.task is None and pending:
                    i = pending.popleft()
                    try:
                        w.sock.sendall((json.dumps([i, tasks[i][0], tasks[i][1]]) + "\n").encode("utf-8"))
                        w.task = (i, time.monotonic() + self.timeout_s)
                    except OSError:
                        results[i] = ("error", "worker connection closed")
                        self._replace(k)
            busy = [w for w in self.workers if w.task]
            for w in wait(busy, timeout=max(0.0, min(w.task[1] for w in busy) - time.monotonic())):
                lines = w.read_lines()
                if lines is None:  # died (e.g. killed by the OS): fail its task, replace it
                    results[w.task[0]] = ("error", "worker died")
                    w.task = None
                    self._replace(self.workers.index(w))
                    continue
                for tid, status, value in lines:
                    if w.task and tid == w.task[0]:
                        results[tid] = (status, value)
                        w.task = None
            now = time.monotonic()
            for k, w in enumerate(self.workers):
                if w.task and now >= w.task[1]:
                    results[w.task[0]] = ("timeout", None)
                    self._replace(k)
        return [results.get(i, ("error", "lost")) for i in range(len(tasks))]

    def close(self) -> None:
        """Stop the workers and the zygote (idempotent)."""
        for w in self.workers:
            w.kill()
        self.workers = []
        if self._ctl is not None:
            self._ctl_lines.close()
            self._ctl.close()
            self._ctl = None
        if self._zygote is not None:
            if self._zygote.poll() is None:
                self._zygote.kill()
            self._zygote.wait()
            self._zygote = None

    def __del__(self):
        with suppress(Exception):
            self.close()


if __name__ == "__main__":
    _zygote_main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
