"""Length Reweighting Error (paper section "Length Fairness and LRE" and appendix), from per-bin sums:

    q_b    = 1 - C_b / n_b        C_b = the bin's sum of per-sequence rejected fractions
    q_bar  = sum_b n_b q_b / sum_b n_b
    LRE    = 0.5 sum_b n_b |q_b / q_bar - 1| / sum_b n_b
    LRE_w  = 0.5 sum_b a_b |q_b / q_bar - 1| / sum_b a_b,   a_b = sum_{i in b} |A_i|

LRE_w is the appendix's weighted LRE with the proxy ||g_L|| ~ mean |A_i| (the n_b cancel); it ignores the
norm of grad log pi, which grows with L. Never NaN: zero-weight bins drop out, and no weight or q_bar = 0
gives 0. ``min_len`` drops bins whose upper edge is <= min_len (the paper excludes L < 1000).
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
from torch import Tensor

from fspo.diagnostics.bins import LengthBins


def acceptance(counts: Tensor, clipped: Tensor) -> Tensor:
    """Per-bin ``q_b = 1 - clipped_b / counts_b`` (float64; 1 for an empty bin, to be given zero weight)."""
    counts = torch.as_tensor(counts).double()
    clipped = torch.as_tensor(clipped, device=counts.device).double()
    safe = counts.clamp_min(1.0)
    return torch.where(counts > 0, 1.0 - clipped / safe, torch.ones_like(counts))


def q_bar(q: Tensor, weights: Tensor) -> Tensor:
    """Weighted mean acceptance ``sum_b w_b q_b / sum_b w_b`` (0-dim float64; 0 when sum w = 0)."""
    q = torch.as_tensor(q).double()
    w = torch.as_tensor(weights, device=q.device).double()
    tot = w.sum()
    return torch.where(tot > 0, (w * q).sum() / tot.clamp_min(1e-300), torch.zeros((), dtype=q.dtype, device=q.device))


def lre(q: Tensor, weights: Tensor, q_bar_weights: Optional[Tensor] = None) -> Tensor:
    """``0.5 sum_b w_b |q_b / q_bar - 1| / sum_b w_b``, q_bar weighted by ``q_bar_weights`` (default ``weights``):
    LRE with w = n_b, LRE_w with w = a_b and q_bar_weights = n_b. 0-dim float64."""
    q = torch.as_tensor(q).double()
    w = torch.as_tensor(weights, device=q.device).double()
    if (w < 0).any():
        raise ValueError("lre: weights must be non-negative")
    qw = w if q_bar_weights is None else torch.as_tensor(q_bar_weights, device=q.device).double()
    qb = q_bar(q, qw)
    tot = w.sum()
    zero = torch.zeros((), dtype=torch.float64, device=q.device)
    if not bool(tot > 0) or not bool(qb > 0):
        return zero
    dev = torch.where(w > 0, (q / qb - 1.0).abs(), zero)
    return 0.5 * (w * dev).sum() / tot


def min_len_mask(bins: LengthBins, min_len: float = 0) -> Tensor:
    """Bool [n_bins]: True for bins whose upper edge is > ``min_len`` (kept in LRE)."""
    return torch.tensor([u > min_len for u in bins.upper], dtype=torch.bool)


def length_fairness(counts: Tensor, clipped: Tensor, abs_adv: Tensor, bins: LengthBins,
                    min_len: float = 0, prefix: str = "fairness/") -> Dict[str, float]:
    """``<prefix>lre``, ``lre_w``, ``q_bar``, ``n_bins`` from per-bin counts n_b, rejected sums C_b and |A| sums a_b,
    over non-empty bins with upper edge > ``min_len``; {} when none."""
    counts = torch.as_tensor(counts).double()
    keep = min_len_mask(bins, min_len).to(counts.device) & (counts > 0)
    if not bool(keep.any()):
        return {}
    n = torch.where(keep, counts, torch.zeros_like(counts))
    a = torch.where(keep, torch.as_tensor(abs_adv, device=counts.device).double(), torch.zeros_like(counts))
    q = acceptance(counts, clipped)
    return {
        f"{prefix}lre": float(lre(q, n)),
        f"{prefix}lre_w": float(lre(q, a, q_bar_weights=n)),
        f"{prefix}q_bar": float(q_bar(q, n)),
        f"{prefix}n_bins": float(keep.sum()),
    }
