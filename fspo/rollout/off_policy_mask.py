"""Off-policy sequence masking (DeepSeek-V3.2's OPSM; TRL ``off_policy_mask_threshold``) and its length-fair
variant. Per sequence i (L_i tokens), with the behaviour log-probs (the engine's where reported, else the
trainer's old ones) and the current policy's (detached):

    K_i = sum_t (log pi_behaviour(y_t) - log pi_theta(y_t))            (the k1 estimate of L_i KL(behaviour || theta))
    mean   keep_i = [A_i >= 0] or [K_i / L_i <= delta]                  DeepSeek-V3.2 and TRL: length-normalised
    sqrt   keep_i = [A_i >= 0] or [K_i <= delta sqrt(L_i)]              the length-fair variant

A masked sequence's tokens get weight 0 (they stay in the denominators). Why sqrt, and the logged fractions:
docs/mismatch.md.
"""
from __future__ import annotations

import math
from typing import Dict, Optional

import torch
from torch import Tensor

from fspo.diagnostics._base import DiagnosticMetric
from fspo.diagnostics.bins import LengthBins

KINDS = ("none", "mean", "sqrt")


class MaskCounts(DiagnosticMetric):
    """Per-length-bin sequence counts, masked counts and summed per-token KL of `OffPolicyMask`."""

    def __init__(self, bins: LengthBins) -> None:
        super().__init__()
        self.bins = bins
        for name in ("n_seq", "masked", "kl"):
            self.add_state(name, torch.zeros(bins.n_bins, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, lengths: Tensor, masked: Tensor, kl_per_token: Tensor) -> None:
        idx = self.bins.index(lengths.long()).to(self.n_seq.device)
        ok = idx >= 0
        i = idx[ok]
        dev = self.n_seq.device
        self.n_seq.index_add_(0, i, torch.ones(int(ok.sum()), dtype=torch.float64, device=dev))
        self.masked.index_add_(0, i, masked.to(dev, torch.float64)[ok])
        self.kl.index_add_(0, i, kl_per_token.to(dev, torch.float64)[ok])

    def compute(self) -> Dict[str, float]:
        out: Dict[str, float] = {}
        for b, label in enumerate(self.bins.labels):
            n = float(self.n_seq[b])
            if n > 0:
                out[f"rollout_corr/opsm_frac/{label}"] = float(self.masked[b]) / n
                out[f"rollout_corr/opsm_kl_mean/{label}"] = float(self.kl[b]) / n
                out[f"rollout_corr/n_seq_opsm/{label}"] = n
        total = float(self.n_seq.sum())
        if total:
            out["rollout_corr/opsm_frac"] = float(self.masked.sum()) / total
        return out


class OffPolicyMask(torch.nn.Module):
    """keep_i; ``kind``: none | mean | sqrt; ``threshold`` delta > 0 (unless none); ``bins``: the diagnostics'."""

    def __init__(self, kind: str = "none", threshold: Optional[float] = None,
                 bins: Optional[LengthBins] = None) -> None:
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"rollout_correction.off_policy_mask must be one of {', '.join(KINDS)}, got {kind!r}")
        if kind != "none" and not (isinstance(threshold, (int, float)) and not isinstance(threshold, bool)
                                   and math.isfinite(threshold) and threshold > 0):
            raise ValueError(f"rollout_correction.off_policy_threshold must be a number > 0 with "
                             f"off_policy_mask={kind} (per token for mean, per sqrt(token) for sqrt), "
                             f"got {threshold!r}")
        self.kind, self.threshold = kind, None if threshold is None else float(threshold)
        self.counts = MaskCounts(bins or LengthBins(width=200, max_len=32768)) if kind != "none" else None

    @property
    def enabled(self) -> bool:
        return self.kind != "none"

    @torch.no_grad()
    def keep(self, behaviour: Tensor, current: Tensor, advantages: Tensor, mask: Tensor) -> Tensor:
        """keep_i [B] float64 (1 where L_i = 0), the diagnostics updated; ``advantages`` [B] or [B, T] (token mean)."""
        m = mask.to(torch.float64)
        length = m.sum(-1)
        k = ((behaviour.to(torch.float64) - current.to(torch.float64)) * m).sum(-1)
        a = advantages.to(torch.float64)
        if a.dim() == 2:
            a = (a * m).sum(-1) / length.clamp(min=1.0)
        limit = self.threshold * (length if self.kind == "mean" else length.sqrt())
        keep = (a >= 0) | (k <= limit) | (length == 0)
        self.counts.update(length, (~keep).to(torch.float64), k / length.clamp(min=1.0))
        return keep.to(torch.float64)

    def compute_metrics(self) -> Dict[str, float]:
        """This step's masked fractions (reduced over ranks), then reset."""
        if self.counts is None or not self.counts.update_count:
            return {}
        out = dict(self.counts.compute())
        self.counts.reset()
        return out
