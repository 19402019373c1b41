"""How far one RL step moved the trainable weights, logged every step:

    train/update_ratio = ||theta_new - theta_old|| / ||theta_old||

over every trainable parameter together, theta_old the weights the step's rollouts were sampled with. Updates
that round away (bfloat16 weights at small lr) or are all skipped show 0; a healthy AdamW step moves it by
about lr / |w|. Under FSDP the squared norms are summed over the ranks' shards.
"""
from __future__ import annotations

from typing import Iterable, List, Optional

import torch
from torch import Tensor

from fspo.runtime.launch.distributed import reduce_sum


def _local(p: Tensor) -> Tensor:
    """This rank's part of ``p``: a DTensor's local shard, else ``p`` itself."""
    return p.to_local() if hasattr(p, "to_local") else p


class UpdateRatio:
    """`snapshot(params)` at the start of a step, `compute(params)` at its end (same parameters, same order)."""

    def __init__(self) -> None:
        self._old: Optional[List[Tensor]] = None

    @torch.no_grad()
    def snapshot(self, params: Iterable[Tensor]) -> "UpdateRatio":
        """Copy this rank's part of every trainable parameter of ``params``; returns self."""
        self._old = [_local(p).detach().clone() for p in params if p.requires_grad]
        return self

    @torch.no_grad()
    def compute(self, params: Iterable[Tensor], device=None) -> float:
        """The ratio (float64 sums over ranks; 0.0 for all-zero weights), dropping the snapshot. Collective."""
        if self._old is None:
            raise RuntimeError("UpdateRatio.compute called before snapshot")
        new = [_local(p).detach() for p in params if p.requires_grad]
        if len(new) != len(self._old):
            raise RuntimeError(f"UpdateRatio: {len(new)} trainable parameters now, {len(self._old)} at the snapshot")
        sums = None  # [||new - old||^2, ||old||^2] summed on the device: one host read at the end, not two per tensor
        for a, b in zip(new, self._old):
            part = torch.stack([torch.linalg.vector_norm(a - b, dtype=torch.float64),
                                torch.linalg.vector_norm(b, dtype=torch.float64)]) ** 2
            sums = part if sums is None else sums + part.to(sums.device)
        self._old = None
        diff2, old2 = reduce_sum(sums.tolist() if sums is not None else [0.0, 0.0], device)
        return (diff2 ** 0.5) / (old2 ** 0.5) if old2 > 0 else 0.0
