"""A rollout engine in its own process, so that generation overlaps the trainer's update.

Owns: `AsyncEngine` (the trainer-side handle: `start`, `push`, `submit`, `result`, `close`) and
`_engine_main` (the child process). The child holds its own copy of the policy (rebuilt from the
policy's config, plain sdpa attention) and an engine built from the same ``rollout.engine`` config
(`fspo.rollout.hf.HFEngine`), with ``threads`` torch threads of its own. Leaves out: which step is
requested when (pipeline.py) and scoring (callback.py).

Weights: ``slots`` parameter buffers in shared memory (one per request that can be in flight), keyed by
checkpoint name. `push` copies the trainer's current parameters into a slot (a memcpy, no pickling),
streamed by `fspo.rollout.weights.iter_full_state_dict`: under FSDP every DTensor is gathered to its
full value, one at a time, so each rank's engine process holds the full weights. That gather is a
collective: under torch.distributed every rank must call `start` and `push` at the same points (the
pipeline's schedule is the same on every rank). A request names
its slot, and the child loads that slot into its model when it starts the request. A slot is written
only when no request still in flight reads it (the pipeline collects request i before it reuses
request i's slot), so every rollout is generated with exactly the weights pushed for it — the
behaviour policy the engine's log-probs (``engine_log_probs``) belong to.

The child answers requests in order; `result` returns the `RolloutBatch` of the oldest request
(its tensors come back through torch.multiprocessing's shared memory). An exception in the child is
sent back and raised by `result` with the child's traceback text; a dead child is reported instead
of waiting forever; an alive child that answers nothing within ``timeout_s`` is killed and reported
(`EngineUnresponsive`), and a stop signal during a wait (``should_stop``) raises Lightning's
``SIGTERMException`` so the run checkpoints and exits as the synchronous path does. The child dies with the trainer,
however the trainer ends (`die_with_parent`).
"""
from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
import traceback
from typing import Dict, List, Sequence

import torch
import torch.multiprocessing as mp

from fspo.rollout.base import SamplingConfig
from fspo.rollout.weights import iter_full_state_dict
from fspo.types import RolloutBatch

log = logging.getLogger(__name__)
POLL_S = 1.0


def die_with_parent(parent_pid: int, poll_s: float = POLL_S) -> None:
    """Make this process end when ``parent_pid`` does, however it ends (kill -9 included): the kernel's
    ``PR_SET_PDEATHSIG`` = SIGKILL on Linux, and on every platform a daemon thread that polls the
    parent pid (also covering a parent that died before the prctl call)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except Exception:  # noqa: BLE001 - not Linux: the watchdog below covers it
        pass

    def watch():
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        os._exit(1)  # orphaned: the trainer is gone

    if os.getppid() != parent_pid:
        os._exit(1)
    threading.Thread(target=watch, daemon=True, name="fspo-engine-parent-watch").start()


def _engine_main(config, tokenizer, engine, slots: List[Dict[str, torch.Tensor]], threads: int, requests, results,
                 parent_pid: int = 0):
    """The child: build the model, then answer ``(slot, prompt ids, params)`` requests until None."""
    if parent_pid:
        die_with_parent(parent_pid)
    try:
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(max(1, int(threads)))
        config._attn_implementation = "sdpa"
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
        engine.setup(model, tokenizer, "")
    except Exception:  # noqa: BLE001 - reported to the trainer
        results.put(("error", traceback.format_exc()))
        return
    results.put(("ready", None))
    while True:
        req = requests.get()
        if req is None:
            return
        slot, prompt_ids, params = req
        try:
            model.load_state_dict(slots[slot], strict=True)
            results.put(("ok", engine.generate(prompt_ids, params)))
        except Exception:  # noqa: BLE001
            results.put(("error", traceback.format_exc()))


class EngineUnresponsive(RuntimeError):
    """The engine process is alive but answered nothing within ``rollout.overlap.timeout_s``."""


class AsyncEngine:
    """Trainer-side handle of the engine process (see the module docstring)."""

    def __init__(self, engine, slots: int = 1, threads: int = 1, timeout_s: float = 1800.0):
        if slots < 1:
            raise ValueError(f"rollout.overlap.staleness must be >= 1, got {slots}")
        self.engine, self.n_slots, self.threads = engine, int(slots), int(threads)
        self.timeout_s = float(timeout_s)  # the longest wait for one answer (rollout.overlap.timeout_s)
        self.should_stop = lambda: False  # set by the rollout callback: a stop signal (SIGTERM) ends a wait
        self.proc = None
        self.slots: List[Dict[str, torch.Tensor]] = []

    def start(self, policy, tokenizer) -> None:
        """Allocate the shared weight slots from ``policy``'s full weights and start the child (waits until
        its model is built). Under torch.distributed: a collective, every rank calls it."""
        if any(p.device.type == "cuda" for p in policy.parameters()):
            raise RuntimeError(
                "rollout.overlap.enable=true: the pipelined engine process generates with the HF engine on CPU, "
                "which a GPU trainer would wait for; on GPUs use the colocated vLLM engine (rollout=vllm "
                "rollout.overlap.enable=false: it time-shares each GPU through sleep/wake)")
        self.slots = [{} for _ in range(self.n_slots)]
        with torch.no_grad():
            for name, t in iter_full_state_dict(policy):
                t = t.to("cpu")
                for slot in self.slots:
                    slot[name] = t.clone().share_memory_()
        ctx = mp.get_context("spawn")
        self.requests, self.results = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=_engine_main, daemon=True, name="fspo-engine",
                                args=(policy.config, tokenizer, self.engine, self.slots, self.threads,
                                      self.requests, self.results, os.getpid()))
        self.proc.start()
        # answers are received on a thread: unpickling a rollout's tensors asks the child for their shared
        # memory, which blocks forever if the child is stopped; the waits below stay bounded
        self._answers: "queue.Queue" = queue.Queue()
        threading.Thread(target=self._receive, args=(self.results, self._answers), daemon=True,
                         name="fspo-engine-receiver").start()
        kind, payload = self._get()
        if kind != "ready":
            raise RuntimeError(f"the rollout engine process failed to start:\n{payload}")

    def push(self, policy, slot: int) -> None:
        """Copy ``policy``'s current full parameters into weight slot ``slot`` (no request may be reading it).
        Under torch.distributed: a collective, every rank calls it."""
        with torch.no_grad():
            for k, v in iter_full_state_dict(policy):  # full tensors, gathered one at a time under FSDP
                self.slots[slot][k].copy_(v)

    def submit(self, slot: int, prompt_ids: Sequence[List[int]], params: SamplingConfig) -> None:
        """Queue a generation with the weights in ``slot``; returns at once."""
        self.requests.put((slot, [list(map(int, p)) for p in prompt_ids], params))

    def result(self) -> RolloutBatch:
        """The rollout of the oldest request not collected yet (blocks until it is done)."""
        kind, payload = self._get()
        if kind != "ok":
            raise RuntimeError(f"the rollout engine process failed: {payload.strip().splitlines()[-1]}\n{payload}")
        return payload

    @staticmethod
    def _receive(results, answers) -> None:
        while True:
            try:
                answers.put(results.get())
            except Exception:  # noqa: BLE001 - the child is gone (its end of the pipe closed)
                answers.put(("error", traceback.format_exc()))
                return

    def _get(self):
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                return self._answers.get(timeout=POLL_S)
            except queue.Empty:
                if self.proc is None or not self.proc.is_alive():
                    code = None if self.proc is None else self.proc.exitcode
                    raise RuntimeError(f"the rollout engine process died (exit code {code}); "
                                       f"see the log above") from None
                if self.should_stop():  # SIGTERM while waiting: stop as the synchronous path does (checkpoint, exit 0)
                    from lightning.pytorch.utilities.exceptions import SIGTERMException

                    log.warning("stop signal while waiting for the rollout engine: stopping this step")
                    self.kill()  # its work is not needed; a stopped child would block the interpreter's exit
                    raise SIGTERMException() from None
                if time.monotonic() > deadline:
                    pid = self.proc.pid
                    self.kill()
                    raise EngineUnresponsive(
                        f"the rollout engine process (pid {pid}) sent nothing for {self.timeout_s:.0f} s "
                        f"(rollout.overlap.timeout_s): it is stopped or hung, and was killed. Continue from the "
                        f"last checkpoint with resume=auto; raise rollout.overlap.timeout_s if one step's "
                        f"generation really takes that long") from None

    def close(self) -> None:
        """Stop the child (requests still queued are dropped); a stopped or hung child is killed."""
        if self.proc is not None and self.proc.is_alive():
            self.requests.put(None)
            self.proc.join(timeout=10)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(timeout=10)
        self.proc = None

    def kill(self) -> None:
        """Kill the child now (a stopped or hung one too) and reap it."""
        if self.proc is not None:
            if self.proc.is_alive():
                self.proc.kill()
            self.proc.join(timeout=10)
        self.proc = None

    def __del__(self):  # a trainer that dies must not leave the child behind
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass
