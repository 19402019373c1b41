"""Pipelined rollouts (``rollout.overlap``): the engine generates step t+k's batch while the trainer updates on step t.

Owns: `OverlapConfig` (``rollout.overlap``: ``enable``, ``staleness`` k, ``engine_threads``) and
`RolloutPipeline`, which keeps k training requests in flight on an `fspo.rollout.async_engine.AsyncEngine`.
Leaves out: the engine process (async_engine.py), prompts, scoring and advantages
(callback.py).

Schedule, with W_s the policy's weights at the end of RL step s (W_{-1}: the initial ones). At the
start of step t the trainer holds W_{t-1} and requests t .. t+k-1 are in flight:

    1. collect step t's rollout (generated with W_{t-1-k}: k steps stale; k = 1 by default, so the
       engine generates step t+1 with W_{t-1} while the trainer computes W_t from step t's batch);
    2. push W_{t-1} into the weight slot request t used (free now) and submit request t+k with it;
    3. the trainer updates on step t's rollout while the engine generates step t+k.

When the pipeline is empty (the first step, and the first step after a resume) requests t .. t+k-1
are all submitted with the current weights, so the in-flight batches of a killed run are regenerated,
not checkpointed: a resumed run's first k steps are fresher than those of an uninterrupted one.

The behaviour policy of every rollout is the engine's (the weights its slot held), and its
log-probs come with the rollout (``engine_log_probs``), so the importance ratio is taken against
the policy that sampled it (``ppo.old_log_probs=engine``, enforced by fspo/runtime/checks/config_check.py);
the clip rules, FSPO's band and the rollout-correction diagnostics apply unchanged, now measuring a
k-step policy lag too. Requests past ``last_step`` are not submitted. The lag of each rollout taken
(``RolloutPipeline.lag``) goes with the batch as ``policy_lag``: with lag > 0 the step's first mini-batch
is not on-policy and is measured like the others (fspo/update/module.py).

Data parallel (``trainer=fsdp``): every rank has its own engine process, fed the FULL weights gathered
from the shards at each push (async_engine.py), and generates that rank's share of the
prompts; the schedule above is identical on every rank, so the gathers (collectives) line up. This is
the one-step-off layout of verl's recipe with the engine beside the trainer on the host; on GPUs the
colocated vLLM engine (time-shared through sleep/wake) is the supported layout instead.
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
    """``rollout.overlap``: ``enable`` pipelined rollouts, ``staleness`` k >= 1 steps of policy lag,
    ``engine_threads`` torch threads of the engine process (the trainer keeps ``cpu_threads``)."""

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
    """Keeps ``staleness`` training requests in flight (see the module docstring)."""

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
        """Step ``step``'s rollout; submits the requests ahead (up to ``last_step``) with ``policy``'s
        current weights. ``request(s)`` gives step s's prompt token ids and sampling settings. After the
        call ``lag`` is the rollout's policy lag: RL steps between the weights that sampled it and ``policy``'s
        (k in steady state; t for the first steps t < k; 0 for a step whose request was submitted now)."""
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
