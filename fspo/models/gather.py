"""Whole weights from sharded ones, gathered in the dtype their consumer holds them in.

Owns: `wire_dtype` (the dtype a weight crosses the all-gather in), `gathered` (one full tensor from a
plain tensor or an FSDP2 / tensor-parallel DTensor) and `gathered_merge` (a LoRA layer's merged weight
W0 + s B A, merged shard by shard). Leaves out: which weights, in which order and under which names
(fspo/rollout/weights.py, lora.py `merged_weights`).

Why cast first: under FSDP the trainer keeps float32 masters while a vLLM engine on a GPU holds
bfloat16 weights. Gathering float32 shards and casting the whole tensor afterwards sends 4 bytes per
element over the wire and keeps a float32 full tensor alive until the cast; casting each rank's shard
to bfloat16 first (an elementwise op on the DTensor: no communication, its placements kept) and then
gathering sends 2 and never builds the float32 whole. The result is bit-identical: rounding acts on
each element alone, so cast-then-concatenate equals concatenate-then-cast.

``full_tensor()`` is a collective: every rank of the mesh must call these functions for the same
tensors in the same order, with the same ``dtype``.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def wire_dtype(own: torch.dtype, target: Optional[torch.dtype]) -> torch.dtype:
    """The dtype a floating-point weight of dtype ``own`` is gathered in for a consumer holding ``target``:
    ``target`` when it is no wider than ``own`` (fewer or as many bytes on the wire), else ``own`` (a wider
    consumer widens on its own copy; casting up first would double the bytes sent). None: ``own``."""
    if target is None or not own.is_floating_point or not target.is_floating_point:
        return own
    return target if target.itemsize <= own.itemsize else own


def gathered(t: Tensor, dtype: Optional[torch.dtype] = None) -> Tensor:
    """The full, detached value of ``t`` in `wire_dtype(t.dtype, dtype)`: a DTensor is cast shard by shard
    (no communication) and then all-gathered (a collective); a plain tensor is cast (no copy when the
    dtype is already right). Non-floating tensors keep their dtype."""
    t = t.detach()
    want = wire_dtype(t.dtype, dtype)
    if t.dtype != want:
        t = t.to(want)  # DTensor: each rank casts its own shard, placements unchanged
    full = getattr(t, "full_tensor", None)  # torch.distributed.tensor.DTensor
    return full() if full is not None else t


def _same_rows(w: Tensor, b: Tensor) -> bool:
    """True when DTensors ``w`` [out, in] and ``b`` [out, r] hold the same rows on every rank: one mesh,
    every mesh dimension sharding dim 0 (FSDP2's placement), the same number of rows."""
    from torch.distributed.tensor import DTensor, Shard

    return (isinstance(w, DTensor) and isinstance(b, DTensor) and w.device_mesh == b.device_mesh
            and w.placements == b.placements and all(p == Shard(0) for p in w.placements)
            and w.shape[0] == b.shape[0])


def gathered_merge(w: Tensor, a: Tensor, b: Tensor, scale: float, dtype: Optional[torch.dtype] = None) -> Tensor:
    """The full merged weight W = W0 + scale * B A of a LoRA layer (W0 ``w`` [out, in], A ``a`` [r, in],
    B ``b`` [out, r]), in `wire_dtype(w.dtype, dtype)`.

    The merge runs in float32 whatever the dtypes: the adapter's update is small beside W0 (its scale times
    lr-sized steps), and adding it in bfloat16 would round most of it away before the engine sees it; only
    the merged sum is rounded, once. When W0 and B are FSDP2-sharded alike (dim 0 on one mesh), each rank
    merges its own rows, W0_rows + scale * B_rows A, with A (r rows, small) gathered in float32, casts them
    and the merged weight is gathered in the narrow dtype; otherwise (plain tensors, other placements) W0,
    A and B are gathered first and merged whole. Both compute W0 + scale * B A in float32 and round it once
    to the output dtype; a row block of B A may differ from the whole product only in the matmul's summation
    order (bit-identical on CPU in tests/test_weight_sync_dtype.py).
    """
    want = wire_dtype(w.dtype, dtype)
    if _same_rows(w, b):
        from torch.distributed.tensor import DTensor

        rows = w.to_local().detach().float() + (b.to_local().detach().float() @ gathered(a).float()) * scale
        merged = DTensor.from_local(rows.to(want), w.device_mesh, w.placements, shape=w.shape, stride=w.stride(),
                                    run_check=False)
        return merged.full_tensor()
    w0 = gathered(w)
    return (w0.float() + (gathered(b).float() @ gathered(a).float()) * scale).to(want)
