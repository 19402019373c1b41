"""``train/update_ratio``: how far one RL step moved the trainable weights, relative to their size.

Owns: `UpdateRatio`. Per RL step, over the trainable parameters theta (with LoRA: the adapters only),

    update_ratio = ||theta_after - theta_before||_2 / ||theta_before||_2     (0 when ||theta_before|| = 0)

It keeps a copy of the trainable parameters for the step, so it is measured only when they number at
most ``max_params`` (default 50M: every LoRA run, and full fine-tuning of the small models); above
that it returns None and nothing is logged. DTensor (FSDP) parameters are reduced to full norms.
Leaves out: the optimizer step itself (fspo/update/module.py).
"""
from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor, nn


def _sq(t: Tensor) -> Tensor:
    s = t.detach().float().pow(2).sum()
    full = getattr(s, "full_tensor", None)
    return full() if full is not None else s


class UpdateRatio:
    """``start(model)`` before the step's first update, ``finish(model)`` after its last: the ratio or None."""

    def __init__(self, max_params: int = 50_000_000):
        self.max_params = max_params
        self._before: Optional[List[Tensor]] = None

    def start(self, model: nn.Module) -> None:
        params = [p for p in model.parameters() if p.requires_grad]
        if sum(p.numel() for p in params) > self.max_params:
            self._before = None
            return
        self._before = [p.detach().clone() for p in params]

    @torch.no_grad()
    def finish(self, model: nn.Module) -> Optional[float]:
        if self._before is None:
            return None
        params = [p for p in model.parameters() if p.requires_grad]
        num = sum((_sq(p - q) for p, q in zip(params, self._before)), torch.zeros(()))
        den = sum((_sq(q) for q in self._before), torch.zeros(()))
        self._before = None
        return float(num.sqrt() / den.sqrt()) if float(den) > 0 else 0.0
