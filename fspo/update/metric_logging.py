"""Where a step's metrics go: the experiment loggers and Lightning's callback metrics.

Every metric is written once to each of ``module.loggers`` at our RL step (its key laid out by
fspo/diagnostics/metric_keys.py) and put in ``trainer.callback_metrics`` (what ModelCheckpoint and EarlyStopping
``monitor`` read) as a float32 CPU tensor, the type ``LightningModule.log`` stores. Only progress-bar and
epoch-level metrics go through ``log``, which costs ~0.6 ms a call (~8% of the default CPU step for ~90 metrics).
"""
from __future__ import annotations

from typing import Dict, Iterable

import torch

from fspo.diagnostics.metric_keys import display_key, headline
from fspo.runtime.launch.distributed import attached_trainer


def emit_metrics(module, metrics: Dict[str, float], step: int, prog_bar: Iterable[str] = (),
                 on_step: bool = True) -> None:
    """Log ``metrics`` to each of ``module.loggers`` at ``step`` and mirror them into Lightning."""
    shown = {display_key(k): v for k, v in metrics.items()}
    shown.update(headline(metrics))  # copies in the first chart section (metric_keys.py)
    for logger in module.loggers:
        logger.log_metrics(shown, step=int(step))
    prog_bar = set(prog_bar)
    trainer = attached_trainer(module)
    direct = {}
    for k, v in metrics.items():
        if k in prog_bar or not on_step or trainer is None:
            module.log(k, float(v), prog_bar=k in prog_bar, logger=False, on_step=on_step, on_epoch=not on_step,
                       batch_size=1, sync_dist=False)
        else:
            direct[k] = torch.tensor(float(v), dtype=torch.float32)
    if direct:
        trainer.callback_metrics.update(direct)
