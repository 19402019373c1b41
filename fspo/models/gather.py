"""Whole weights from sharded ones, gathered in the dtype their consumer holds them in.

Under FSDP the trainer keeps float32 masters while a vLLM engine on a GPU holds bfloat16. Casting each rank's
shard first (elementwise on the DTensor: no communication) and then gathering sends half the bytes and never
builds the float32 whole; rounding acts on each element alone, so the result is bit-identical.
``full_tensor()`` is a collective: every rank calls these for the same tensors in the same order and ``dtype``.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def wire_dtype(own: torch.dtype, target: Optional[torch.dtype]) -> torch.dtype:
    """The dtype a floating-point weight of dtype ``own`` is gathered in for a consumer holding ``target``:
    ``target`` when no wider than ``own``, else (or None) ``own``."""
    if target is None or not own.is_floating_point or not target.is_floating_point:
        return own
    return target if target.itemsize <= own.itemsize else own


def gathered(t: Tensor, dtype: Optional[torch.dtype] = None) -> Tensor:
    """The full, detached value of ``t`` in `wire_dtype(t.dtype, dtype)`: a DTensor cast shard by shard, then
    all-gathered."""
    t = t.detach()
    want = wire_dtype(t.dtype, dtype)
    if t.dtype != want:
        t = t.to(want)  # DTensor: each rank casts its own shard, placements unchanged
    full = getattr(t, "full_tensor", None)  # torch.distributed.tensor.DTensor
    return full() if full is not None else t


def _same_rows(w: Tensor, b: Tensor) -> bool:
    """DTensors ``w`` [out, in] and ``b`` [out, r] hold the same rows on every rank (FSDP2's Shard(0))."""
    from torch.distributed.tensor import DTensor, Shard

    return (isinstance(w, DTensor) and isinstance(b, DTensor) and w.device_mesh == b.device_mesh
            and w.placements == b.placements and all(p == Shard(0) for p in w.placements)
            and w.shape[0] == b.shape[0])


def gathered_merge(w: Tensor, a: Tensor, b: Tensor, scale: float, dtype: Optional[torch.dtype] = None) -> Tensor:
    """The full merged weight W = W0 + scale * B A of a LoRA layer (W0 ``w`` [out, in], A ``a`` [r, in],
    B ``b`` [out, r]) in `wire_dtype(w.dtype, dtype)`, merged in float32 and rounded once (a small adapter
    update added in bfloat16 would be rounded away). Sharded alike, each rank merges its own rows and the
    result is gathered in the narrow dtype; otherwise W0, A and B are gathered and merged whole."""
    want = wire_dtype(w.dtype, dtype)
    if _same_rows(w, b):
        from torch.distributed.tensor import DTensor

        rows = w.to_local().detach().float() + (b.to_local().detach().float() @ gathered(a).float()) * scale
        merged = DTensor.from_local(rows.to(want), w.device_mesh, w.placements, shape=w.shape, stride=w.stride(),
                                    run_check=False)
        return merged.full_tensor()
    w0 = gathered(w)
    return (w0.float() + (gathered(b).float() @ gathered(a).float()) * scale).to(want)
