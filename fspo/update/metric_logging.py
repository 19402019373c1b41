"""Where a step's metrics go: the experiment loggers (MLflow, and any of conf/logger/) and Lightning's callback metrics.

Owns: `emit_metrics`. Leaves out: computing the metrics (module.py, stats.py,
fspo/diagnostics) and the logger itself (conf/logger).

Every metric is written once to each experiment logger (``module.loggers``) at step ``step`` (its key laid
out by fspo/diagnostics/metric_keys.py: one MLflow chart section per family) (our RL step, not
Lightning's counter) and made visible to callbacks in ``trainer.callback_metrics`` (what
ModelCheckpoint / EarlyStopping ``monitor`` read). Only the progress-bar metrics (and epoch-level
ones, e.g. validation) go through ``LightningModule.log``: each ``log`` call costs ~0.6 ms on CPU
(Lightning wraps every value in a torchmetrics result and moves it to the device), which for the
~90 metrics of an RL step was ~60 ms a step, 8% of the default step on a 2-core CPU. The others are
set in ``trainer.callback_metrics`` (the dict Lightning keeps and returns; it resets it only when
a fit or sanity check starts) as float32 CPU tensors, the type ``log`` would have stored.
"""
from __future__ import annotations

from typing import Dict, Iterable

import torch

from fspo.diagnostics.metric_keys import display_key, headline
from fspo.runtime.launch.distributed import attached_trainer


def emit_metrics(module, metrics: Dict[str, float], step: int, prog_bar: Iterable[str] = (),
                 on_step: bool = True) -> None:
    """Log ``metrics`` to each of ``module.loggers`` at ``step`` and mirror them into Lightning (see module
    docstring)."""
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
