"""A stop signal (SIGTERM, or a ``checkpoint.signals`` one) that does not wait for the end of a long step.

Owns: `install_sigterm` (a SIGTERM handler without collectives), `request_stop`, `stop_requested`,
`interruptible` (the rank-local part of a step's rollout that a stop signal cuts short), `synced_stops` /
`synced_stop_wanted` (a lockstep generation's own all-reduces carry the stop vote) and `agree_stop` (every
rank takes the same decision). Leaves out: writing the checkpoint and stopping the fit
(fspo/runtime/checkpoints/checkpointing.py) and where the rollout calls these (fspo/rollout/callback.py).

Why: a launcher gives the ranks a grace between its SIGTERM and its SIGKILL (torchrun: ``--shutdown-timeout``,
default 30 s; SLURM: ``KillWait``, default 30 s; Kubernetes: ``terminationGracePeriodSeconds``). A stop at
the next step boundary loses everything when the step in progress outlasts the grace. Until a step's first
optimizer update, the module, optimizer and loop state are still those after the previous step, which is
consistent and can be saved at once: a signal that arrives while the rollout generates (a rank-local engine)
or scores interrupts it (`StepInterrupted`, a `BaseException` so that a reward's ``except Exception`` does not
swallow it), every rank agrees at `agree_stop` right after that part (one all-reduce; a rank that saw no
signal follows the others), and the caller rewinds the step (prompt sampler, RNG) and raises Lightning's
``SIGTERMException``, whose handler writes the checkpoint of the last completed step and exits 0.
A synced (FSDP) generation is a chain of collectives and cannot be cut at any point: its per-token
"any row still running?" all-reduce (fspo/rollout/decode.py) carries each rank's vote, so all ranks leave it
at the same token. Weight sync, ``compact: false`` generation and the update are not cut: a signal there
stops at the next safe point (after the rollout, or the step boundary).

Lightning's own SIGTERM handler broadcasts a tensor from inside the handler (lightning 2.6), a collective at
whatever point the signal interrupts, which can pair with a different collective on another rank;
`install_sigterm` replaces it during fit with one that only records the signal (the decision is then reduced
over ranks at fixed points: here and in `StepCheckpoint`).

Outside the training loop (from the first line of ``train()`` to Lightning's ``on_train_start``: config checks,
model loading, Lightning's setup, the step-0 validation; and after the fit: the final validation and artifacts)
there is nothing a checkpoint would add: `honour_stop_signals` installs a handler for SIGTERM, SIGINT (Ctrl-C)
and ``checkpoint.signals`` that stops there at once with `StopNow` (Lightning's ``SIGTERMException``, exit 0;
Lightning's own handler only sets a flag that its next ``fit`` forgets). Inside the fit a first SIGINT is a
stop signal like SIGTERM (the checkpoint of the last completed step, then exit 0); a second SIGINT raises
``KeyboardInterrupt`` at once.
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
    """Whether a stop signal now stops at once (`StopNow`): outside the training loop, see the module docstring.
    Returns the previous setting."""
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
    """SIGTERM, SIGINT and the ``extra`` signal names stop the run (module docstring) for the duration of the
    block; the previous handlers come back after it; ``outside``: what the line of a stop outside a fit says.
    Off the main thread: a no-op."""
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
    """A block of lockstep collectives (FSDP generation) whose agreement points may stop it: inside it
    `synced_stop_wanted` reports a recorded stop; every rank must enter it at the same point."""
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
    """A block that a stop signal interrupts with `StepInterrupted` (raised at once when one is already
    recorded). Only for code that runs no collective and changes no state that a checkpoint holds."""
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
    """Replace the SIGTERM handler (Lightning's, during fit) with one that records the signal (`request_stop`)
    and sets ``trainer.received_sigterm`` as Lightning's does, forwarding the signal to processes Lightning
    launched itself, without a collective. Returns the previous handler (None off the main thread)."""
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
    """Make Lightning's loop counters those of the end of the last completed batch (what a checkpoint written
    at its ``on_train_batch_end`` holds), for a step abandoned in its ``on_train_batch_start``: there
    Lightning has counted the new batch as ``ready`` only, and a checkpoint of that state resumes with its
    validation schedule shifted (validations at steps 5, 8 instead of 3, 6 with ``val.every_n_steps=3``).
    Before: ready = k + 1, started = processed = completed = k; after: ready = started = processed = k,
    completed = k - 1 and ``_batches_that_stepped`` = k - 1, which Lightning's restart completes again."""
    loop = trainer.fit_loop.epoch_loop
    done = loop.batch_progress.total.completed
    for counter in (loop.batch_progress.total, loop.batch_progress.current):
        counter.ready -= 1
        if done > 0:
            counter.completed -= 1
    if done > 0:
        loop._batches_that_stepped -= 1
