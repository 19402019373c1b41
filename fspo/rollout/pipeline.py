"""Pipelined rollouts (``rollout.overlap``): the engine generates step t+k's batch while the trainer updates on
step t, with k requests in flight on an `AsyncEngine`. With W_s the weights after RL step s, step t collects its
rollout (generated with W_{t-1-k}), pushes W_{t-1} into the freed slot and submits request t+k. An empty pipeline
(the first step, a resume) submits t .. t+k-1 with the current weights. Every rollout carries the engine's
log-probs (``ppo.old_log_probs=engine``) and its lag as ``policy_lag``. Under data parallelism each rank has its
own engine process, fed the FULL weights on the same schedule.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from fspo.rollout.async_engine import AsyncEngine
from fspo.rollout.base import SamplingConfig
from fspo.types import RolloutBatch

Request = Tuple[Sequence[List[int]], SamplingConfig]


@dataclass
class OverlapConfig:
    """``rollout.overlap``: ``staleness`` k >= 1 steps of policy lag, ``engine_threads`` of the engine process."""

    enable: bool = False
    staleness: int = 1
    engine_threads: int = 1
    timeout_s: float = 1800.0  # the longest wait for the engine's answer

    def __post_init__(self):
        if int(self.staleness) < 1:
            raise ValueError(f"rollout.overlap.staleness must be >= 1 (steps of policy lag), got {self.staleness}")
        if int(self.engine_threads) < 1:
            raise ValueError(f"rollout.overlap.engine_threads must be >= 1, got {self.engine_threads}")


def build_pipeline(cfg) -> Optional["RolloutPipeline"]:
    """The pipeline ``cfg.rollout.overlap`` asks for (a second `rollout.engine` in its own process), or None."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    node = OmegaConf.select(cfg, "rollout.overlap")
    over = OverlapConfig(**OmegaConf.to_container(node, resolve=True)) if node is not None else OverlapConfig()
    if not over.enable:
        return None
    return RolloutPipeline(AsyncEngine(instantiate(cfg.rollout.engine), slots=over.staleness,
                                       threads=over.engine_threads, timeout_s=over.timeout_s), over.staleness)


class RolloutPipeline:
    """Keeps ``staleness`` training requests in flight."""

    def __init__(self, engine: AsyncEngine, staleness: int = 1):
        self.engine, self.k = engine, int(staleness)
        self.in_flight: List[int] = []  # steps submitted and not collected, oldest first
        self.submitted_at: Dict[int, int] = {}  # step -> the trainer's step when it was submitted (weights W_{that-1})
        self.lag = 0  # policy lag of the last rollout taken: optimizer steps between its weights and the trainer's

    def _submit(self, step: int, policy, request: Callable[[int], Request], now: int) -> None:
        slot = step % self.k
        self.submitted_at[step] = now
        self.engine.push(policy, slot)
        prompt_ids, params = request(step)
        self.engine.submit(slot, prompt_ids, params)
        self.in_flight.append(step)

    def take(self, step: int, last_step: int, policy, request: Callable[[int], Request],
             timings: Optional[Dict[str, float]] = None) -> RolloutBatch:
        """Step ``step``'s rollout, submitting the requests ahead (up to ``last_step``; ``request(s)``: step s's
        prompt ids and sampling settings) with ``policy``'s weights; ``lag`` is then the rollout's policy lag."""
        if not self.in_flight or self.in_flight[0] != step:  # first step, or a resume: start over
            self.reset()
            for s in range(step, min(step + self.k, last_step + 1)):
                self._submit(s, policy, request, step)
        t0 = time.perf_counter()
        rollout = self.engine.result()
        self.in_flight.pop(0)
        self.lag = step - self.submitted_at.pop(step)  # k in steady state; fewer for the first k steps
        t1 = time.perf_counter()
        if step + self.k <= last_step:
            self._submit(step + self.k, policy, request, step)
        if timings is not None:
            timings["time/generate"] = t1 - t0  # waiting for the engine (what overlap did not hide)
            timings["time/weight_sync"] = time.perf_counter() - t1
        return rollout

    def start(self, policy, tokenizer) -> None:
        """Start the engine process on ``policy``'s weights, once (later calls do nothing)."""
        if self.engine.proc is None:
            self.engine.start(policy, tokenizer)

    def reset(self) -> None:
        """Drop every request still in flight (their results are read and discarded)."""
        while self.in_flight:
            self.engine.result()
            self.submitted_at.pop(self.in_flight.pop(0), None)

    def close(self) -> None:
        """Stop the engine process."""
        self.in_flight, self.submitted_at = [], {}
        self.engine.close()
