"""A stop signal (SIGTERM, or a ``checkpoint.signals`` one) that does not wait for the end of a long step.

A launcher's grace between SIGTERM and SIGKILL (torchrun, SLURM: 30 s by default) can be shorter than a step.
Until a step's first optimizer update the state is still that after the previous step, so it can be saved at
once: a signal during the rank-local rollout interrupts it (`StepInterrupted`, a `BaseException` so that a
reward's ``except Exception`` does not swallow it), every rank agrees at `agree_stop` (one all-reduce), and the
caller rewinds the step and raises Lightning's ``SIGTERMException``, which saves the last completed step and
exits 0. A synced (FSDP) generation cannot be cut anywhere: its per-token all-reduce carries each rank's vote
(`synced_stops`). Weight sync and the update are not cut: a signal there stops at the next safe point.

Outside the training loop (setup, step-0 and final validation) there is nothing to checkpoint:
`honour_stop_signals` stops there at once with `StopNow`.
"""
from __future__ import annotations

import contextlib
import logging
import signal
import threading
from typing import Iterator, Sequence

from lightning.pytorch.utilities.exceptions import SIGTERMException

log = logging.getLogger(__name__)

_state = {"requested": False, "zone": 0, "synced": 0, "outside_fit": False, "name": None,
          "outside": "stopping now (no training step is lost)"}


class StepInterrupted(BaseException):
    """Raised by a stop signal inside `interruptible`: this step's rollout is abandoned."""


class StopNow(SIGTERMException):
    """A stop signal outside the training loop (setup, step-0 or final validation): the run stops at once."""

    def __init__(self, name: str):
        super().__init__()
        self.signal_name = name


def request_stop(name: str) -> None:
    """Record a stop signal; inside `interruptible` (main thread), interrupt the running code at once."""
    first = not _state["requested"]
    _state["requested"] = True
    _state["name"] = _state["name"] or name
    if first and _state["outside_fit"]:
        log.warning("received %s: %s", name, _state["outside"])
    elif first:
        log.warning("received %s: saving a checkpoint at the next safe point, then stopping%s", name,
                    " (Ctrl-C again stops at once, without it)" if name == "SIGINT" else "")
    if _state["zone"] > 0 and threading.current_thread() is threading.main_thread():
        raise StepInterrupted(name)


def stop_requested() -> bool:
    """Whether this process received a stop signal since `reset`."""
    return bool(_state["requested"])


def stop_signal_name() -> str:
    """The name of the first stop signal recorded since `reset` ("SIGTERM" when none was)."""
    return str(_state["name"] or "SIGTERM")


def reset() -> None:
    """Forget a recorded stop (a new fit in the same process)."""
    _state["requested"], _state["zone"], _state["synced"], _state["name"] = False, 0, 0, None


def set_outside_fit(outside: bool) -> bool:
    """Whether a stop signal now stops at once (`StopNow`); returns the previous setting."""
    old, _state["outside_fit"] = bool(_state["outside_fit"]), bool(outside)
    return old


def _on_stop_signal(signum, frame) -> None:
    name = signal.Signals(signum).name
    if name == "SIGINT" and stop_requested():
        raise KeyboardInterrupt  # a second Ctrl-C: stop at once
    request_stop(name)  # inside an interruptible rollout this raises StepInterrupted
    if _state["outside_fit"] and threading.current_thread() is threading.main_thread():
        raise StopNow(name)


@contextlib.contextmanager
def honour_stop_signals(extra: Sequence[str] = (), outside: str = "stopping now (no training step is lost)"
                        ) -> Iterator[None]:
    """SIGTERM, SIGINT and the ``extra`` signals stop the run inside the block (main thread only); ``outside``:
    what the line of a stop outside a fit says."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    sigs = {signal.SIGTERM, signal.SIGINT} | {getattr(signal, str(n)) for n in extra
                                              if str(n) not in ("SIGKILL", "SIGSTOP") and hasattr(signal, str(n))}
    reset()
    _state["outside"] = outside
    old = {s: signal.signal(s, _on_stop_signal) for s in sigs}
    set_outside_fit(True)
    try:
        yield
    finally:
        set_outside_fit(False)
        for s, h in old.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)


@contextlib.contextmanager
def synced_stops() -> Iterator[None]:
    """A block of lockstep collectives (FSDP generation) in which `synced_stop_wanted` reports a recorded stop."""
    _state["synced"] += 1
    try:
        yield
    finally:
        _state["synced"] -= 1


def synced_stop_wanted() -> bool:
    """This rank's vote at an agreement point of `synced_stops` (False outside one, e.g. during validation)."""
    return _state["synced"] > 0 and stop_requested()


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """A block that a stop signal interrupts with `StepInterrupted`: only code that runs no collective and
    changes no state a checkpoint holds."""
    if _state["requested"]:
        raise StepInterrupted("an earlier signal")
    _state["zone"] += 1
    try:
        yield
    finally:
        _state["zone"] -= 1


def agree_stop(local: bool, device=None) -> bool:
    """True on every rank when ``local`` or a recorded stop is True on any rank (one all-reduce)."""
    from fspo.runtime.launch.distributed import any_rank

    return any_rank(bool(local) or stop_requested(), device)


def install_sigterm(trainer):
    """Replace Lightning's SIGTERM handler with one that does what it does without a collective (records the
    signal, forwards it to launched processes). Returns the previous handler (None off the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    connector = getattr(trainer, "_signal_connector", None)

    def on_sigterm(signum, frame) -> None:
        launcher = getattr(trainer.strategy, "launcher", None)
        if connector is not None:
            if not connector.received_sigterm and launcher is not None:
                launcher.kill(signum)
            connector.received_sigterm = True
        request_stop("SIGTERM")

    return signal.signal(signal.SIGTERM, on_sigterm)


def rewind_to_last_step_end(trainer) -> None:
    """Set Lightning's loop counters to those at the end of the last completed batch, for a step abandoned in
    ``on_train_batch_start`` (else the resumed validation schedule shifts)."""
    loop = trainer.fit_loop.epoch_loop
    done = loop.batch_progress.total.completed
    for counter in (loop.batch_progress.total, loop.batch_progress.current):
        counter.ready -= 1
        if done > 0:
            counter.completed -= 1
    if done > 0:
        loop._batches_that_stepped -= 1
