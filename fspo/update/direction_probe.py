"""`RandomDirectionGate`: the length law a random parameter direction gives, the gate of the law probe.

Before each update it moves the policy by eps u (u_p ~ N(0, 1) per parameter tensor, ||u_p|| = eps ||p||, seeded
by (seed, step)), records S_rand = sum_t (log pi_{theta + eps u} - log pi_theta) per sequence in the ledger with
``update = -1`` and puts the weights back exactly. To first order S_rand is a sum of zero-mean score terms, so its
std grows as L^(1/2) when the per-token sensitivity is the same at every position: an exponent well below 1/2
means the model and task cannot show the sqrt(L) law. One process only; two forward passes per step.
"""
from __future__ import annotations

import logging

import lightning as L
import torch

from fspo.runtime.launch.distributed import dp_rank_size
from fspo.seeds import step_seed
from fspo.update import forward as passes

log = logging.getLogger(__name__)


class RandomDirectionGate(L.Callback):
    """``eps``: relative size of the direction."""

    def __init__(self, eps: float = 1e-3, seed: int = 0):
        self.eps, self.seed, self._warned = float(eps), int(seed), False

    @torch.no_grad()
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        rollout = batch.get("rollout") if isinstance(batch, dict) else None
        if rollout is None or getattr(pl_module, "ledger", None) is None:
            return
        if dp_rank_size(pl_module)[1] > 1:
            if not self._warned:
                log.warning("the random-direction gate runs on one process only; skipped under %d ranks",
                            dp_rank_size(pl_module)[1])
                self._warned = True
            return
        step = int(pl_module.rl_step)
        base = passes.old_log_probs(pl_module, rollout)
        g = torch.Generator().manual_seed(step_seed(self.seed, step))
        moved = []
        for p in pl_module.policy.parameters():
            if not p.requires_grad:
                continue
            u = torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.device)
            u = u * (self.eps * p.detach().float().norm() / u.norm().clamp(min=1e-12))
            moved.append((p, p.detach().clone()))
            p.add_(u.to(p.dtype))
        try:
            shifted = passes.old_log_probs(pl_module, rollout)
        finally:
            for p, saved in moved:  # exactly the weights before
                p.copy_(saved)
        pl_module.ledger.update(step, -1, rollout.group_ids, rollout.lengths, shifted - base,
                                rollout.response_mask, torch.zeros(rollout.batch_size),
                                torch.ones_like(rollout.response_mask, dtype=torch.bool))
