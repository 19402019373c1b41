"""What a resumable checkpoint holds beyond Lightning's own state: RNG states and metric states.

torchmetrics states are non-persistent (the module state dict leaves them out), yet ``run_diagnostics``
accumulates over the whole run. All values are tensors or plain Python objects, so checkpoints load with
``torch.load(weights_only=True)``.
"""
from __future__ import annotations

import logging
import random
from typing import Any, Dict

import numpy as np
import torch

log = logging.getLogger(__name__)


def rng_states() -> Dict[str, Any]:
    """The global RNG states: torch CPU, every CUDA device, numpy, python."""
    kind, key, pos, has_gauss, gauss = np.random.get_state()
    out = {"torch": torch.get_rng_state(), "python": random.getstate(),
           "numpy": (kind, torch.from_numpy(key.astype(np.int64)), int(pos), int(has_gauss), float(gauss))}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_states(s: Dict[str, Any]) -> None:
    """Inverse of `rng_states`."""
    torch.set_rng_state(s["torch"])
    kind, key, pos, has_gauss, gauss = s["numpy"]
    np.random.set_state((kind, key.numpy().astype(np.uint32), pos, has_gauss, gauss))
    random.setstate(s["python"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def metric_states(root: torch.nn.Module) -> Dict[str, Any]:
    """``{module name: {"state": tensors, "updates": n}}`` for every torchmetrics Metric under ``root``."""
    from torchmetrics import Metric

    out = {}
    for name, m in root.named_modules():
        if isinstance(m, Metric):
            m.persistent(True)
            try:
                sd = {k: v.detach().cpu().clone() if torch.is_tensor(v) else v for k, v in m.state_dict().items()}
            finally:
                m.persistent(False)
            out[name] = {"state": sd, "updates": int(getattr(m, "_update_count", 0))}
    return out


def load_metric_states(root: torch.nn.Module, saved: Dict[str, Any]) -> None:
    """Inverse of `metric_states` (tensors go to the device of the states they replace)."""
    from torchmetrics import Metric

    for name, m in root.named_modules():
        if isinstance(m, Metric) and name in saved:
            sd = {k: v.to(getattr(m, k).device) if torch.is_tensor(v) and torch.is_tensor(getattr(m, k, None)) else v
                  for k, v in saved[name]["state"].items()}
            m.persistent(True)
            try:
                m.load_state_dict(sd, strict=False)
            finally:
                m.persistent(False)
            m._update_count = saved[name]["updates"]
            m._computed = None


def extend_finished_run(trainer, checkpoint: Dict[str, Any], step: int) -> None:
    """A finished run resumed with more ``steps``: its last batch is no longer the epoch's last, else
    Lightning's restored loop would end the fit at once."""
    progress = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_loop.batch_progress") or {}
    steps = getattr(getattr(trainer.datamodule, "sampler", None), "steps", None)
    if progress.get("is_last_batch") and steps is not None and int(steps) > step:
        progress["is_last_batch"] = False
        log.info("extending the finished run from step %d to %d", step, int(steps))
