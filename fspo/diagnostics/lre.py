"""Length Reweighting Error (paper section "Length Fairness and LRE" and the appendix), pure functions.

Owns: acceptance rates per length bin and LRE / LRE_w from per-bin sums. Leaves out: collecting
the sums (clip_fraction.py) and which event counts as "rejected" (the caller passes C_b).

Definitions implemented (bins b stand for lengths L; the paper's appendix justifies binning):

    q_b    = 1 - C_b / n_b            acceptance of bin b; C_b = sum over its sequences of the
                                      per-sequence rejected fraction (0/1 for sequence-level rules)
    q_bar  = sum_b n_b q_b / sum_b n_b = E_L[q(L)], sample-count weighted (paper: q_bar = E[q(L)])
    LRE    = 0.5 * sum_b n_b |q_b / q_bar - 1| / sum_b n_b       = 0.5 E_L |q(L)/q_bar - 1|

    LRE_w  = 0.5 E_L[ |q(L)/q_bar - 1| * ||g_L|| / E_L||g_L|| ]  (paper appendix, "Weighted-LRE")

For LRE_w we use the proxy ||g_L|| ~ mean_{i in b} |A_i| = a_b / n_b with a_b = sum_{i in b} |A_i|.
With E_L taken over the sample distribution (p_b = n_b / N) the n_b cancel:

    LRE_w  = 0.5 * sum_b a_b |q_b / q_bar - 1| / sum_b a_b,   q_bar still count-weighted as above.

So `lre(q, weights=a, q_bar_weights=n)` is exactly the appendix formula under this proxy. The proxy
ignores the norm of the score function grad log pi(y), which grows with L; it is a cheap stand-in
(the exact per-bin gradient norm would need one backward pass per bin).

The paper's LRE (``fairness/lre``) takes C_b = sequences whose ratio lies outside the band (the
paper's acceptance event A_L, whatever the advantage's sign: ``ClipResult.in_band``); the binding
LRE (``fairness/binding_lre``) takes C_b = binding clips (depend on sign(A), count the dual clip).
Both go through `length_fairness`, with different ``prefix``.

Conventions (no NaN ever): bins with zero weight contribute nothing (so empty bins drop out);
with no weight at all, or q_bar = 0 (everything clipped, no direction to compare), LRE := 0.
``min_len`` excludes bins whose upper edge is <= min_len (the paper excludes L < 1000: with
200-token bins, ``min_len=1000`` keeps [1000, 1200) and drops [800, 1000)).
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
from torch import Tensor

from fspo.diagnostics.bins import LengthBins


def acceptance(counts: Tensor, clipped: Tensor) -> Tensor:
    """Per-bin acceptance ``q_b = 1 - clipped_b / counts_b`` (float64; 1.0 where counts_b == 0).

    ``clipped`` is the per-bin sum of per-sequence clip fractions (a count for sequence rules).
    Empty bins get q = 1 (no evidence of clipping); give them zero weight in `lre`.
    """
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
    """``0.5 * sum_b w_b |q_b/q_bar - 1| / sum_b w_b`` with ``q_bar = q_bar(q, q_bar_weights or weights)``.

    LRE: ``weights = q_bar_weights = n_b``. LRE_w (appendix, proxy ||g_L|| = mean |A|):
    ``weights = sum_b |A|``, ``q_bar_weights = n_b``. Returns a 0-dim float64 tensor; 0 when
    ``sum w == 0`` or ``q_bar == 0`` (documented convention, never NaN).
    """
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
    """``<prefix>lre``, ``<prefix>lre_w``, ``<prefix>q_bar``, ``<prefix>n_bins`` from per-bin sums.

    ``counts`` n_b, ``clipped`` C_b (per-bin sum of per-sequence rejected fractions, so
    q_b = 1 - C_b / n_b), ``abs_adv`` a_b = sum_{i in b} |A_i| (LRE_w's proxy). ``prefix``
    ``"fairness/"`` for the paper's acceptance, ``"fairness/binding_"`` for binding clips.
    Bins with upper edge <= ``min_len`` and empty bins are excluded. Returns {} when no sequence
    is left (nothing to report rather than NaN).
    """
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
