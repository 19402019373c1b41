"""`FairnessMetrics`: the one object the training module holds for length-fairness diagnostics; the caller logs
its flat MLflow-safe dict and figures. ``compute()`` is a collective under DDP/FSDP: call it on all ranks.

    self.fairness = FairnessMetrics(LengthBins(width=200, max_len=18000), lre_min_len=1000)
    self.fairness.update_rollout(batch.lengths, batch.overlong)          # each rollout batch
    self.fairness.update_clip(res, batch.lengths, mask, adv, log_ratio=not on_policy)   # each mini-batch
    self.log_dict(self.fairness.compute()); self.fairness.reset()        # each logging interval
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
    """Raise ValueError naming the first key that is not MLflow-safe (``METRIC_NAME_RE``)."""
    for k in metrics:
        if not METRIC_NAME_RE.match(k):
            raise ValueError(f"metric name {k!r} is not MLflow-safe: use letters, digits and _ - . / : space")


class FairnessMetrics(torch.nn.Module):
    """Length-fairness diagnostics of one run; ``metric_kwargs`` (``process_group``, ``sync_on_compute``) go to
    each of its metrics.

    The first mini-batch of a step is on-policy (S = 0, always in band): the log-ratio statistics and, unless
    ``acceptance_on_policy``, the acceptance counts leave it out (as the paper's Figure 1 count); the binding
    clips always count it.
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
        self.acf = TokenLogRatioACF(bins, **metric_kwargs)
        self._last: Optional[Dict[str, float]] = None

    @torch.no_grad()
    def update_clip(self, result: ClipResult, lengths: Optional[Tensor], response_mask: Tensor,
                    advantages: Tensor, log_ratio: bool = True, on_policy: Optional[bool] = None,
                    token_log_ratio: Optional[Tensor] = None) -> None:
        """Count one (micro-)batch's `ClipResult`: ``lengths`` [B] (None: from the mask), ``response_mask`` [B, T],
        ``advantages`` [B] or [B, T], ``token_log_ratio`` [B, T] (optional, for the autocorrelation).
        ``on_policy`` (None: ``not log_ratio``) as in the class docstring."""
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
        """Flat ``{name: float}`` of every metric, synced across ranks; names MLflow-safe, keys with nothing to report
        absent, no NaN."""
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
        """``clip_fraction_by_length``, ``logratio_qq``, ``logratio_std_vs_len`` of the last `compute()` (run first if
        none). ``theory``: c(L) curves beside the observed out-of-band fraction (plots.py)."""
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
        """Zero every metric state (after each logging interval)."""
        for m in (self.clip, self.log_ratio, self.rollout, self.acf):
            m.reset()
        self._last = None
