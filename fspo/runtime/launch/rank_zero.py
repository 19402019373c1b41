"""Which process is rank zero, and the logger the other ranks get.

Owns the one notion of "rank zero" the run code uses, in two forms:
- `launch_rank`: the rank the launcher gave this process, from its environment; valid before
  torch.distributed or Lightning start (the output-folder lock, moving damaged checkpoints aside,
  choosing the logger);
- `is_rank_zero`: Lightning's global rank (``rank_zero_only.rank``, which Lightning sets from the same
  environment at import and again when its strategy starts), for code that runs once the trainer
  exists; inside a Lightning callback ``trainer.is_global_zero`` is the same fact.
and `RankZeroStub` (the logger that ranks other than 0 get in fspo/train.py). Leaves out: the sharding and the rank
arithmetic of the step (distributed.py).
"""
from __future__ import annotations

import os

from lightning.pytorch.loggers.logger import DummyExperiment, Logger


def launch_rank() -> int:
    """This process's global rank as its launcher set it (torchrun ``RANK``, SLURM ``SLURM_PROCID``,
    Lightning's own launcher ``NODE_RANK``/``LOCAL_RANK``), readable before torch.distributed starts;
    0 when launched alone."""
    for key in ("RANK", "SLURM_PROCID"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    others = [os.environ.get(k, "0") for k in ("NODE_RANK", "LOCAL_RANK")]
    return 0 if all(v in ("", "0") for v in others) else 1  # Lightning's launcher: only "is it 0" is known


def is_rank_zero() -> bool:
    """True on Lightning's global rank 0 (see the module docstring); `launch_rank` before Lightning has set it."""
    from lightning.pytorch.utilities import rank_zero_only

    return getattr(rank_zero_only, "rank", launch_rank()) == 0


class RankZeroStub(Logger):
    """The logger of ranks other than 0: every call is accepted and does nothing, ``run_id`` is None,
    ``experiment`` swallows any method call.

    Lightning's loggers write on rank 0 only anyway; building the MLflow client on every rank would
    race on the store (SQLite schema creation) and open runs that never get data.
    """

    run_id = None
    name = "rank_zero_stub"
    version = 0

    @property
    def experiment(self):
        """A no-op object (Lightning's ``DummyExperiment``)."""
        return DummyExperiment()

    def log_metrics(self, metrics, step=None) -> None:
        """Do nothing."""

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        """Do nothing."""
