"""The hand-over of accelerator memory between the trainer and a colocated rollout engine: the ONE place that
orders the memory steps around a generation, in verl's order (table: docs/vllm_engine.md). The engine's weights
wake before the trainer's parameters are gathered into them and its KV cache only after the gathered copies are
gone, so the peak is max(trainer, engine weights + one gathered tensor, engine weights + KV cache), not their sum.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, Optional

import torch

WEIGHTS, KV_CACHE = "weights", "kv_cache"  # vLLM's wake_up tags


def _empty_cache() -> None:
    """``torch.cuda.empty_cache()`` when CUDA is in use, else nothing."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def offload_optimizer_state(optimizer) -> None:
    """Move every tensor of ``optimizer.state`` to CPU (DTensors keep their sharding; step counters too)."""
    for state in optimizer.state.values():
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                state[k] = v.to("cpu", non_blocking=True)


def restore_optimizer_state(optimizer) -> None:
    """Move ``optimizer.state`` back to its parameters' devices (scalar ``step`` tensors stay where they are)."""
    for p, state in optimizer.state.items():
        for k, v in state.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                state[k] = v.to(p.device, non_blocking=True)


@contextmanager
def rollout_memory(engine, policy, optimizers: Iterable = (), offload_optimizer: bool = False,
                   empty_cache: Optional[Callable[[], None]] = None) -> Iterator[None]:
    """Run the body (a generation) with the engine woken and synced: drop gradients, offload the optimizer state
    (``offload_optimizer``), wake the weights, sync, wake the KV cache; then sleep and restore, also on error."""
    empty = empty_cache or _empty_cache
    optimizers = list(optimizers or ())
    for p in policy.parameters():
        p.grad = None
    if offload_optimizer:
        for opt in optimizers:
            offload_optimizer_state(opt)
    empty()
    try:
        engine.wake([WEIGHTS])
        engine.sync_weights(policy)
        empty()
        engine.wake([KV_CACHE])
        yield
    finally:
        engine.sleep()
        empty()
        if offload_optimizer:
            for opt in optimizers:
                restore_optimizer_state(opt)
