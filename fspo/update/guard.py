"""The divergence guard: limits on each update's gradient norm, loss and KL, checked before the optimizer step,
over the update's whole mini-batch (all ranks together):

    grad_norm  the global gradient norm before clipping (``train/grad_norm``)
    loss       |sum_t m l_t| / sum_t m, the mean per-token surrogate loss, whatever ``loss_agg_mode``
    kl         mean_t k3_t, k3 = r - 1 - log r, r = exp(logp_current - logp_old) (``train/kl``)

A null limit is not checked. On a breach ``action`` decides: ``stop`` raises `DivergenceError` (checkpoints
stay), ``skip`` drops the update exactly, ``warn`` logs and steps; ``off`` checks nothing; breaches count in
``guard/trips``. Ranks agree on the verdict. A diverging update looks normal itself: the next one shows it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import List, Optional

import torch
from torch import Tensor

from fspo.runtime.launch.distributed import any_rank, reduce_sum
from fspo.update.settings import GuardSettings
from fspo.update.stats import k3_sum_tensor

log = logging.getLogger(__name__)


class DivergenceError(ValueError):
    """Training diverged past a ``guard.*`` limit; the message names the measure and the settings to change."""


class UpdateMeter:
    """Sums over one update's micro-batches (this rank's share): token loss, k3 KL and tokens."""

    def __init__(self):
        self.loss_sum, self.kl_sum, self.tokens = 0.0, 0.0, 0.0
        self._pending: Optional[Tensor] = None  # [loss, kl, tokens] on the device, read once by `flush`

    @torch.no_grad()
    def add(self, token_loss: Tensor, logp: Tensor, old: Tensor, mask: Tensor) -> None:
        """Add one micro-batch: per-token loss, current and old log-probs, response mask (all [b, T])."""
        m = mask.float()
        part = torch.stack([(token_loss.detach().float() * m).sum(), k3_sum_tensor(logp.detach(), old, mask),
                            m.sum()]).double()
        self._pending = part if self._pending is None else self._pending + part.to(self._pending.device)

    def flush(self) -> None:
        """Read the device sums into ``loss_sum``, ``kl_sum``, ``tokens`` (one host read)."""
        if self._pending is not None:
            loss, kl, n = self._pending.tolist()
            self.loss_sum, self.kl_sum, self.tokens = self.loss_sum + loss, self.kl_sum + kl, self.tokens + n
            self._pending = None


@dataclass
class DivergenceGuard(GuardSettings):
    """Limits checked before every optimizer step (`GuardSettings`: the keys, defaults and ranges)."""

    @property
    def enabled(self) -> bool:
        limits = (self.max_grad_norm, self.max_loss, self.max_kl)
        return self.action != "off" and any(v is not None for v in limits)

    def breaches(self, grad_norm: float, loss: float, kl: float) -> List[str]:
        """The exceeded limits as ``"<measure> <value> > guard.<key>=<limit>"`` (empty: within limits)."""
        out = []
        for name, value, key in (("grad norm", grad_norm, "max_grad_norm"), ("loss", abs(loss), "max_loss"),
                                 ("KL", kl, "max_kl")):
            limit = getattr(self, key)
            if limit is not None and value > float(limit):
                out.append(f"{name} {value:.3g} > guard.{key}={float(limit):g}")
        return out

    def check(self, grad_norm: Tensor, meter: UpdateMeter, device=None, where: str = "", lr: float = 0.0) -> str:
        """``"step"``, ``"warn"`` or ``"skip"`` for one update; raises `DivergenceError` with ``stop``.
        Collective: every rank calls it for every update (``where`` and ``lr`` only go into the message)."""
        if not self.enabled:
            return "step"
        meter.flush()
        loss_sum, kl_sum, tokens = reduce_sum([meter.loss_sum, meter.kl_sum, meter.tokens], device)
        tokens = max(tokens, 1.0)
        found = self.breaches(float(grad_norm), loss_sum / tokens, kl_sum / tokens)
        if not any_rank(bool(found), device):  # the same verdict on every rank
            return "step"
        what = "; ".join(found) or "a limit was exceeded on another rank"
        if self.action == "stop":
            raise DivergenceError(
                f"training diverged at {where}: {what}. Lower ppo.lr (now {lr:g}), or set "
                f"guard.action=skip (drop such updates) / warn, or raise the guard.* limit; checkpoints already "
                f"written are kept (continue with resume=auto)")
        log.warning("divergence guard at %s: %s -- %s", where, what,
                    "update skipped" if self.action == "skip" else "stepping anyway (guard.action=warn)")
        return "skip" if self.action == "skip" else "warn"
