"""The hand-over of accelerator memory between the trainer and a colocated rollout engine.

Owns: `rollout_memory`, the ONE place that orders the memory steps around a generation, and its two
helpers `offload_optimizer_state` / `restore_optimizer_state`. Leaves out: what the engine does in
each step (base.py, vllm.py) and when rollouts happen (callback.py).

The order is verl's (its FSDP-vLLM sharding manager, later ``rollout_mode``/``trainer_mode`` of
verl/workers/fsdp_workers.py): the engine's weights come back before the trainer's full parameters are
gathered into them, and its KV cache only after the gathered copies are gone, so the peak on a shared
GPU is max(trainer, engine weights + one gathered tensor, engine weights + KV cache), not their sum:

    enter: 1. gradients dropped (``p.grad = None``: the next update starts with ``zero_grad`` anyway)
           2. optimizer state moved to CPU        (only with ``offload_optimizer``)
           3. empty_cache()                       (hand the freed blocks back to the driver)
           4. engine.wake(["weights"])
           5. engine.sync_weights(policy)         (one gathered tensor at a time: weights.py)
           6. empty_cache()
           7. engine.wake(["kv_cache"])
    body:  generation
    exit:  8. engine.sleep()                      (vLLM: weights to CPU, KV cache freed)
           9. empty_cache()
          10. optimizer state back on its parameters' devices (only with ``offload_optimizer``)

Engines without sleep mode (the HF engine, vLLM on CPU) make steps 4, 7 and 8 no-ops; without CUDA
``empty_cache`` does nothing.
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
    """Move ``optimizer.state`` back to the device of the parameter it belongs to (undoes `offload_optimizer_state`).

    Scalar ``step`` tensors stay where they are (AdamW keeps them on CPU unless fused/capturable)."""
    for p, state in optimizer.state.items():
        for k, v in state.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                state[k] = v.to(p.device, non_blocking=True)


@contextmanager
def rollout_memory(engine, policy, optimizers: Iterable = (), offload_optimizer: bool = False,
                   empty_cache: Optional[Callable[[], None]] = None) -> Iterator[None]:
    """Run the body (a generation) with the engine woken and synced, in the module docstring's order.

    Args:
        engine: a `fspo.rollout.base.RolloutEngine` (``wake(tags)``, ``sync_weights(model)``, ``sleep()``).
        policy: the trainer's policy module, whose current parameters the engine receives.
        optimizers: the trainer's optimizers (their state is offloaded with ``offload_optimizer``).
        offload_optimizer: move optimizer state to CPU while the engine holds memory.
        empty_cache: returns cached blocks to the driver; default ``torch.cuda.empty_cache`` under CUDA.
    Sleep and the restore run also when the body raises.
    """
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
