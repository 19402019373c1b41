"""A rollout engine in its own process (an `HFEngine` on its own copy of the policy), so that generation
overlaps the trainer's update. `push` copies the trainer's full parameters into one of ``slots`` shared-memory
buffers (a collective under FSDP); a slot is written only when no request in flight reads it, so every rollout
is generated with exactly the weights pushed for it. A child's exception is raised with its traceback, a dead
child is reported, a silent one is killed after ``timeout_s`` (`EngineUnresponsive`), a stop signal during a wait
raises ``SIGTERMException``, and the child dies with the trainer (`die_with_parent`).
"""
from __future__ import annotations

import ctypes
import logging
import os
import queue
import signal
import threading
import time
import traceback
from contextlib import suppress
from typing import Dict, List, Sequence

import torch
import torch.multiprocessing as mp

from fspo.rollout.base import SamplingConfig
from fspo.rollout.weights import iter_full_state_dict
from fspo.types import RolloutBatch

log = logging.getLogger(__name__)
POLL_S = 1.0


def die_with_parent(parent_pid: int, poll_s: float = POLL_S) -> None:
    """End this process when ``parent_pid`` does (kill -9 included): ``PR_SET_PDEATHSIG`` on Linux, and a
    daemon thread polling the parent pid."""
    with suppress(Exception):  # not Linux: the watchdog below covers it
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG = 1

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
    """Trainer-side handle of the engine process."""

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
        its model is built). A collective."""
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
        # answers received on a thread: unpickling a rollout's tensors asks the child for their shared memory,
        # which blocks forever if the child is stopped; the waits below stay bounded
        self._answers: "queue.Queue" = queue.Queue()
        threading.Thread(target=self._receive, args=(self.results, self._answers), daemon=True,
                         name="fspo-engine-receiver").start()
        kind, payload = self._get()
        if kind != "ready":
            raise RuntimeError(f"the rollout engine process failed to start:\n{payload}")

    def push(self, policy, slot: int) -> None:
        """Copy ``policy``'s full parameters into weight slot ``slot`` (no request may be reading it). A collective."""
        with torch.no_grad():
            for k, v in iter_full_state_dict(policy):
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
                if self.should_stop():  # SIGTERM while waiting: stop as the synchronous path does
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
        self.kill()

    def kill(self) -> None:
        """Kill the child now (a stopped or hung one too) and reap it."""
        if self.proc is not None:
            if self.proc.is_alive():
                self.proc.kill()
            self.proc.join(timeout=10)
        self.proc = None

    def __del__(self):  # a trainer that dies must not leave the child behind
        with suppress(Exception):
            self.close()
