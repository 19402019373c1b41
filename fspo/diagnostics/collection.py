"""`FairnessMetrics`: the one object the training module holds for length-fairness diagnostics.

Owns: bundling `ClipFractionByLength`, `LogRatioStats` and `RolloutLengthStats` as registered
submodules (Lightning moves their states to the device; torchmetrics syncs them across ranks on
`compute()`), the flat MLflow-safe metric dict, and the figures. Leaves out: logging (the caller
hands the dict to ``self.log_dict`` / MLflow and the figures to ``log_figure``).

Usage in a LightningModule (all ranks call compute(): it is a collective under DDP/FSDP):

    self.fairness = FairnessMetrics(LengthBins(width=200, max_len=18000), lre_min_len=1000)
    # on each rollout batch:       self.fairness.update_rollout(batch.lengths, batch.overlong)
    # on each (micro-)batch step:  res = self.clip_rule(logp, old_logp, adv, mask)
    #                              self.fairness.update_clip(res, batch.lengths, mask, adv)
    # at the logging interval:     self.log_dict(self.fairness.compute()); self.fairness.reset()
"""
from __future__ import annotations

import math
import re
import warnings
from typing import Callable, Dict, Mapping, Optional, Union

import numpy as np
import torch
from matplotlib.figure import Figure
from torch import Tensor

from fspo.clipping.base import ClipResult
from fspo.diagnostics.bins import LengthBins
from fspo.diagnostics.clip_fraction import ClipFractionByLength
from fspo.diagnostics.lengths import RolloutLengthStats
from fspo.diagnostics.log_ratio import LogRatioStats
from fspo.diagnostics.plots import plot_clip_fraction_by_length, plot_qq, plot_std_vs_sqrt_len

METRIC_NAME_RE = re.compile(r"^[A-Za-z0-9_\-./: ]+$")


def check_metric_names(metrics: Mapping[str, float]) -> None:
    """Raise ValueError naming the first key that is not MLflow-safe (``^[A-Za-z0-9_\\-./: ]+$``)."""
    for k in metrics:
        if not METRIC_NAME_RE.match(k):
            raise ValueError(f"metric name {k!r} is not MLflow-safe: use letters, digits and _ - . / : space")


class FairnessMetrics(torch.nn.Module):
    """Length-fairness diagnostics for one training run (see the module docstring for usage).

    Submodules: ``clip`` (ClipFractionByLength: ``clip/*``, ``fairness/*``), ``log_ratio``
    (LogRatioStats: ``logratio/*``), ``rollout`` (RolloutLengthStats: ``rollout/*``).
    ``metric_kwargs`` go to every torchmetrics Metric (e.g. ``process_group``, ``sync_on_compute``).
    """

    def __init__(self, bins: LengthBins, lre_min_len: float = 0, reservoir_size: int = 4096,
                 seed: int = 0, **metric_kwargs) -> None:
        super().__init__()
        self.bins = bins
        self.clip = ClipFractionByLength(bins, lre_min_len=lre_min_len, **metric_kwargs)
        self.log_ratio = LogRatioStats(bins, reservoir_size=reservoir_size, seed=seed, **metric_kwargs)
        self.rollout = RolloutLengthStats(**metric_kwargs)
        self._last: Optional[Dict[str, float]] = None

    @torch.no_grad()
    def update_clip(self, result: ClipResult, lengths: Optional[Tensor], response_mask: Tensor,
                    advantages: Tensor, log_ratio: bool = True) -> None:
        """Count one (micro-)batch's binding masks and sequence log-ratios.

        ``result``: the clip rule's ClipResult; ``lengths`` [B] (or None: ``response_mask.sum(-1)``);
        ``response_mask`` [B, T]; ``advantages`` [B] or [B, T]. Call it once per batch you want
        counted (with several PPO epochs, each pass over a batch counts again).
        """
        if lengths is None:
            lengths = torch.as_tensor(response_mask).sum(-1)
        self.clip.update(lengths, response_mask, result.clip_upper, result.clip_lower,
                         result.clip_dual, advantages)
        if log_ratio:  # False for on-policy mini-batches, whose S is identically 0
            self.log_ratio.update(result.seq_log_ratio.detach(), lengths)

    @torch.no_grad()
    def update_rollout(self, lengths: Tensor, overlong: Tensor) -> None:
        """Count one rollout batch: lengths [B] (L = 0 allowed) and overlong flags [B] bool."""
        self.rollout.update(lengths, overlong)

    def compute(self) -> Dict[str, float]:
        """Flat ``{name: float}`` of every metric, synced across ranks (collective: call on all ranks).

        Keys: ``clip/*``, ``fairness/*``, ``logratio/*``, ``rollout/*`` (see each metric's docstring);
        names are checked against ``^[A-Za-z0-9_\\-./: ]+$``. Keys with nothing to report are
        absent; no value is NaN.
        """
        out: Dict[str, float] = {}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*was called before the ``update`` method.*")
            for m in (self.clip, self.log_ratio, self.rollout):
                out.update(m.compute())
        check_metric_names(out)
        bad = [k for k, v in out.items() if not math.isfinite(v)]
        if bad:  # should never happen; drop rather than poison the run's logs
            warnings.warn(f"FairnessMetrics: dropping non-finite metrics {bad}")
            out = {k: v for k, v in out.items() if k not in bad}
        self._last = out
        return out

    def figures(self, theory: Union[None, Callable, Mapping[str, object]] = None) -> Dict[str, Figure]:
        """Figures of the state as of the last `compute()` (which is called first if there was none).

        ``theory``: a callable c(L), ``(L, c)`` arrays, or ``{name: either}`` drawn beside the
        observed clip fractions (e.g. ``{"RLOO": lambda L: c_rloo(L, 0.03, 0.667, 0.4)}``).
        Returns ``{"clip_fraction_by_length", "logratio_qq", "logratio_std_vs_len"}`` -> Figure.
        """
        if self._last is None or self.clip.last_per_bin is None or self.log_ratio.last_per_bin is None:
            self.compute()
        cp, lp = self.clip.last_per_bin, self.log_ratio.last_per_bin
        ok = cp["count"] > 0
        observed = {"sequence": (cp["mean_len"][ok], cp["seq_frac"][ok]),
                    "token": (cp["mean_len"][ok], cp["tok_frac"][ok])}
        two = lp["count"] > 1
        z = self.log_ratio.last_z if self.log_ratio.last_z is not None else np.zeros(0)
        return {
            "clip_fraction_by_length": plot_clip_fraction_by_length(observed, theory),
            "logratio_qq": plot_qq(z),
            "logratio_std_vs_len": plot_std_vs_sqrt_len(lp["mean_len"][two], lp["std"][two],
                                                        sigma=self._last.get("logratio/sigma_hat")),
        }

    def reset(self) -> None:
        """Zero every metric state (call after each logging interval)."""
        for m in (self.clip, self.log_ratio, self.rollout):
            m.reset()
        self._last = None
