"""`FairnessMetrics`: the one object the training module holds for length-fairness diagnostics.

Owns: bundling `ClipFractionByLength`, `LogRatioStats` and `RolloutLengthStats` as registered
submodules (Lightning moves their states to the device; torchmetrics syncs them across ranks on
`compute()`), the flat MLflow-safe metric dict, and the figures. Leaves out: logging (the caller
hands the dict to ``self.log_dict`` / MLflow and the figures to ``log_figure``).

Usage in a LightningModule (all ranks call compute(): it is a collective under DDP/FSDP):

    self.fairness = FairnessMetrics(LengthBins(width=200, max_len=18000), lre_min_len=1000)
    # on each rollout batch:       self.fairness.update_rollout(batch.lengths, batch.overlong)
    # on each (micro-)batch step:  res = self.clip_rule(logp, old_logp, adv, mask)
    #                              self.fairness.update_clip(res, batch.lengths, mask, adv,
    #                                                        log_ratio=not on_policy)
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
from fspo.diagnostics.autocorr import TokenLogRatioACF
from fspo.diagnostics.bins import LengthBins
from fspo.diagnostics.clip_fraction import ClipFractionByLength
from fspo.diagnostics.lengths import RolloutLengthStats
from fspo.diagnostics.log_ratio import LogRatioStats
from fspo.diagnostics.plots import plot_clip_fraction_by_length, plot_qq, plot_std_vs_sqrt_len

METRIC_NAME_RE = re.compile(r"^[A-Za-z0-9_\-./: ]+$")
FIGURE_NOTE = ("The flat theory line assumes std(S_L) = sigma sqrt(L); at tens of tokens the per-token "
               "log-ratios are few and correlated and that law is weak, so a rising curve here is not a failure "
               "of the method (see docs: the length law).")


def check_metric_names(metrics: Mapping[str, float]) -> None:
    """Raise ValueError naming the first key that is not MLflow-safe (``^[A-Za-z0-9_\\-./: ]+$``)."""
    for k in metrics:
        if not METRIC_NAME_RE.match(k):
            raise ValueError(f"metric name {k!r} is not MLflow-safe: use letters, digits and _ - . / : space")


class FairnessMetrics(torch.nn.Module):
    """Length-fairness diagnostics for one training run (see the module docstring for usage).

    Submodules: ``clip`` (ClipFractionByLength: ``band/*``, ``fairness/*`` from the paper's
    acceptance event, ``clip/*`` and ``fairness/binding_*`` from the binding clips), ``log_ratio``
    (LogRatioStats: ``logratio/*``), ``rollout`` (RolloutLengthStats: ``rollout/*``), ``acf``
    (TokenLogRatioACF: ``logratio/acf*``, ``logratio/tok_std*``, when given per-token log-ratios).
    ``metric_kwargs`` go to every torchmetrics Metric (e.g. ``process_group``, ``sync_on_compute``).

    On-policy convention: the first mini-batch of each step is trained before any update, so with
    recomputed old log-probs (or the engine's, sampled by the same weights) its S = 0 and it is always in the
    band (a stale batch, rollout.overlap, is not on-policy: the training step counts it like any other). Like the
    log-ratio statistics (the paper's Figure 1 count, 217,454 ~ 3/4 of 144 x 128 x 16, leaves it out) the acceptance
    counts (``band/*``, ``fairness/lre``, ...) skip it by default (``acceptance_on_policy=False``); the binding-clip
    fractions (``clip/*``, ``fairness/binding_*``) always count it: that is what the optimizer sees. With
    ``acceptance_on_policy=True`` on-policy batches count for acceptance too (q is pulled towards 1 by a quarter of the
    sequences with the paper's 4 mini-batches per step).
    """

    def __init__(self, bins: LengthBins, lre_min_len: float = 0, reservoir_size: int = 4096,
                 seed: int = 0, acceptance_on_policy: bool = False, figure_min_count: int = 20,
                 **metric_kwargs) -> None:
        super().__init__()
        self.bins = bins
        self.figure_min_count = int(figure_min_count)  # bins with fewer sequences are left out of the figure
        self.acceptance_on_policy = bool(acceptance_on_policy)
        self.clip = ClipFractionByLength(bins, lre_min_len=lre_min_len, **metric_kwargs)
        self.log_ratio = LogRatioStats(bins, reservoir_size=reservoir_size, seed=seed, **metric_kwargs)
        self.rollout = RolloutLengthStats(**metric_kwargs)
        self.acf = TokenLogRatioACF(bins, **metric_kwargs)  # per-token d_t along the response (positions in `bins`)
        self._last: Optional[Dict[str, float]] = None

    @torch.no_grad()
    def update_clip(self, result: ClipResult, lengths: Optional[Tensor], response_mask: Tensor,
                    advantages: Tensor, log_ratio: bool = True, on_policy: Optional[bool] = None,
                    token_log_ratio: Optional[Tensor] = None) -> None:
        """Count one (micro-)batch's binding masks, acceptance event and sequence log-ratios.

        ``result``: the clip rule's ClipResult; ``lengths`` [B] (or None: ``response_mask.sum(-1)``);
        ``response_mask`` [B, T]; ``advantages`` [B] or [B, T]. Call it once per batch you want
        counted (with several PPO epochs, each pass over a batch counts again).
        ``on_policy``: the batch is exactly on-policy (S = 0); None means ``not log_ratio`` (the
        training step passes ``log_ratio=False`` for its on-policy mini-batch). An on-policy batch
        is left out of the log-ratio statistics, and of the acceptance counts unless
        ``acceptance_on_policy`` (class docstring); the binding clips always count it.
        ``token_log_ratio`` [B, T] (optional): the per-token d_t, for their autocorrelation (autocorr.py).
        """
        if lengths is None:
            lengths = torch.as_tensor(response_mask).sum(-1)
        if on_policy is None:
            on_policy = not log_ratio
        self.clip.update(lengths, response_mask, result.clip_upper, result.clip_lower, result.clip_dual,
                         advantages, in_band=result.in_band, clip_cap=result.clip_cap,
                         acceptance=self.acceptance_on_policy or not on_policy)
        if log_ratio:  # False for on-policy mini-batches, whose S is identically 0
            self.log_ratio.update(result.seq_log_ratio.detach(), lengths)
            if token_log_ratio is not None:
                self.acf.update(token_log_ratio, response_mask)

    @torch.no_grad()
    def update_rollout(self, lengths: Tensor, overlong: Tensor) -> None:
        """Count one rollout batch: lengths [B] (L = 0 allowed) and overlong flags [B] bool."""
        self.rollout.update(lengths, overlong)

    def compute(self) -> Dict[str, float]:
        """Flat ``{name: float}`` of every metric, synced across ranks (collective: call on all ranks).

        Keys: ``band/*``, ``clip/*``, ``fairness/*``, ``logratio/*``, ``rollout/*`` (see each metric's
        docstring; ``fairness/lre`` is the paper's, from ``in_band``; ``fairness/binding_lre`` is
        that of the binding clips). Names are checked against ``^[A-Za-z0-9_\\-./: ]+$``. Keys with nothing to report
        are absent; no value is NaN.
        """
        out: Dict[str, float] = {}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*was called before the ``update`` method.*")
            for m in (self.clip, self.log_ratio, self.rollout, self.acf):
                out.update(m.compute())
        check_metric_names(out)
        bad = [k for k, v in out.items() if not math.isfinite(v)]
        if bad:  # should never happen; drop rather than poison the run's logs
            warnings.warn(f"FairnessMetrics: dropping non-finite metrics {bad}", stacklevel=2)
            out = {k: v for k, v in out.items() if k not in bad}
        self._last = out
        return out

    def figures(self, theory: Union[None, Callable, Mapping[str, object]] = None) -> Dict[str, Figure]:
        """Figures of the state as of the last `compute()` (which is called first if there was none).

        ``theory``: a callable c(L), ``(L, c)`` arrays, or ``{name: either}`` drawn beside the
        observed out-of-band fraction c(L) = 1 - q(L) (``band/out_frac/*``, the quantity the closed
        forms describe; e.g. ``{"RLOO": lambda L: c_rloo(L, 0.03, 0.667, 0.4)}``); the binding-clip
        fraction (``clip/seq_frac/*``) is drawn as a second, dotted curve.
        Returns ``{"clip_fraction_by_length", "logratio_qq", "logratio_std_vs_len"}`` -> Figure.
        """
        if self._last is None or self.clip.last_per_bin is None or self.log_ratio.last_per_bin is None:
            self.compute()
        cp, lp = self.clip.last_per_bin, self.log_ratio.last_per_bin
        n_min = self.figure_min_count
        ok, okb = cp["count"] >= max(n_min, 1), cp["band_count"] >= max(n_min, 1)
        name = "out of band, c(L) = 1 - q(L)"
        observed = {name: (cp["band_mean_len"][okb], cp["out_frac"][okb])}
        binding = {"binding clip": (cp["mean_len"][ok], cp["seq_frac"][ok])}
        hidden = int(((cp["band_count"] > 0) & ~okb).sum())
        note = (f"n = sequences per bin; {hidden} bin(s) with fewer than {n_min} sequences not drawn. "
                if hidden else "n = sequences per bin. ") + FIGURE_NOTE
        two = lp["count"] > 1
        z = self.log_ratio.last_z if self.log_ratio.last_z is not None else np.zeros(0)
        return {
            "clip_fraction_by_length": plot_clip_fraction_by_length(
                observed, theory, binding=binding, counts={name: cp["band_count"][okb]}, note=note),
            "logratio_qq": plot_qq(z),
            "logratio_std_vs_len": plot_std_vs_sqrt_len(lp["mean_len"][two], lp["std"][two],
                                                        sigma=self._last.get("logratio/sigma_hat")),
        }

    def reset(self) -> None:
        """Zero every metric state (call after each logging interval)."""
        for m in (self.clip, self.log_ratio, self.rollout, self.acf):
            m.reset()
        self._last = None
