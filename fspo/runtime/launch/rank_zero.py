"""Which process is rank zero, and the logger the other ranks get.

`launch_rank` reads the launcher's environment, valid before torch.distributed or Lightning start;
`is_rank_zero` is Lightning's global rank (``trainer.is_global_zero`` inside a callback), once the trainer exists.
"""
from __future__ import annotations

import os

from lightning.pytorch.loggers.logger import DummyExperiment, Logger


def launch_rank() -> int:
    """This process's global rank as its launcher set it (``RANK``, ``SLURM_PROCID``, Lightning's
    ``NODE_RANK``/``LOCAL_RANK``); 0 when launched alone."""
    for key in ("RANK", "SLURM_PROCID"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    others = [os.environ.get(k, "0") for k in ("NODE_RANK", "LOCAL_RANK")]
    return 0 if all(v in ("", "0") for v in others) else 1  # Lightning's launcher: only "is it 0" is known


def is_rank_zero() -> bool:
    """True on Lightning's global rank 0; `launch_rank` before Lightning has set it."""
    from lightning.pytorch.utilities import rank_zero_only

    return getattr(rank_zero_only, "rank", launch_rank()) == 0


class RankZeroStub(Logger):
    """The logger of ranks other than 0: every call does nothing, ``run_id`` is None. Building the MLflow
    client on every rank would race on the store and open runs that never get data. (Not Lightning's
    `DummyLogger`: its catch-all ``__getattr__`` breaks Hydra's ``instantiate(..., logger=[...])``.)"""

    run_id = None
    name = "rank_zero_stub"
    version = 0

    @property
    def experiment(self):
        return DummyExperiment()

    def log_metrics(self, metrics, step=None) -> None:
        pass

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass
