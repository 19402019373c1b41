"""This process's rank on its node (the local rank, which picks the GPU), as the launcher assigned it.

First match wins: Lightning's ``trainer.local_rank`` when the caller has a trainer; ``LOCAL_RANK`` (torchrun,
Lightning); ``SLURM_LOCALID`` (srun); ``OMPI_COMM_WORLD_LOCAL_RANK`` (mpirun); on one node only, the global
rank. Anything else is refused with one line naming the launchers that set it.
"""
from __future__ import annotations

import os
from typing import Mapping, Optional

_ENV_KEYS = ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK")
_PER_NODE_KEYS = ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE")


def local_rank(global_rank: int, world_size: int, trainer_local_rank: Optional[int] = None,
               env: Optional[Mapping[str, str]] = None) -> int:
    """The local rank of the process with ``global_rank`` of ``world_size``."""
    env = os.environ if env is None else env
    if trainer_local_rank is not None:
        return int(trainer_local_rank)
    for key in _ENV_KEYS:
        value = env.get(key)
        if value not in (None, ""):
            return int(value)
    per_node = next((int(str(env[k]).split("(")[0]) for k in _PER_NODE_KEYS if env.get(k)), None)
    if world_size <= 1 or (per_node is not None and world_size <= per_node):
        return int(global_rank)
    raise ValueError(
        f"cannot tell the local rank of global rank {global_rank} of {world_size} processes (no LOCAL_RANK, "
        f"SLURM_LOCALID or OMPI_COMM_WORLD_LOCAL_RANK in the environment): launch with torchrun, srun "
        f"(SLURM) or mpirun, or set LOCAL_RANK for each process")
