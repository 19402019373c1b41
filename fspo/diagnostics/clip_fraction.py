"""Clip fractions and the paper's acceptance rate by response length, and the LRE, as a torchmetrics
`Metric` with sum-reduced states.

Owns: `ClipFractionByLength`. Leaves out: the clip decisions themselves (fspo/clipping: binding
masks, ``in_band`` and ``clip_cap`` in `ClipResult`) and the LRE formulas (lre.py).

Two different events are counted per sequence (docs/metrics.md):

- acceptance (the paper's section "Length Fairness and LRE"): the ratio lies inside the rule's
  band, whatever the advantage's sign (``ClipResult.in_band``: FSPO lo_L <= S <= hi_L; RLOO
  exp(S) in [1 - eps_low, 1 + eps_high]; GSPO exp(S/L) likewise; GRPO per token). Its rate q(L)
  gives the paper's LRE, and c(L) = 1 - q(L) is the clip probability of the paper's closed forms
  (theory.py). Reported as ``band/*`` and ``fairness/*``.
- binding clip: the clipped branch is the one the pessimistic min selects and differs from the
  unclipped one (depends on sign(A), includes the dual clip): what the optimizer sees. Reported as
  ``clip/*`` and ``fairness/binding_*``. The float-safety cap (|log ratio| > 20, no rule clip
  binding) is counted apart, as ``clip/seq_frac_cap``, and is not in ``any``.

Per bin b (see bins.py) it keeps only sums, reduced across ranks with ``sum``, so values are exact
for any split over ranks and micro-batches:

    n_seq[b]            sequences with L_i in b (L_i = sum_t m_it > 0; L = 0 rows are in no bin)
    n_tok[b]            sum_i L_i
    len_sum[b]          sum_i L_i (float64, for plotting at the bin's mean length)
    frac_<k>[b]         sum_i f_ik,  f_ik = (sum_t clip_k[i,t] m_it) / L_i, k in upper/lower/dual/any/cap
    tok_<k>[b]          sum_i sum_t clip_k[i,t] m_it
    abs_adv[b]          sum_i |A_i|      (LRE_w's gradient-norm proxy: ||g_L|| ~ mean_{i in b} |A_i|)
    band_n_seq[b], band_n_tok[b], band_abs_adv[b]
                        n_seq, n_tok, abs_adv over the sequences counted for acceptance
    band_in[b]          sum_i g_i,  g_i = (sum_t in_band[i,t] m_it) / L_i  (the in-band fraction)
    band_in_tok[b]      sum_i sum_t in_band[i,t] m_it

f_ik and g_i are exactly 0 or 1 for sequence-level rules (their decision is broadcast over tokens)
and fractional for token-level rules (GRPO). ``any = upper | lower | dual`` per token.

Which batches count for acceptance: every `update` with ``in_band`` given and ``acceptance=True``.
`FairnessMetrics` passes ``acceptance=False`` for the exactly on-policy mini-batch of each step
(S = 0, always in band) unless built with ``acceptance_on_policy=True``; the binding-clip states
count every batch. So ``band/*`` and ``fairness/*`` may cover fewer sequences than ``clip/*``.

`compute()` returns floats (per-bin keys only for non-empty bins; never NaN):

    band/out_frac/<label>          1 - band_in[b] / band_n_seq[b]: the paper's c(L) = 1 - q(L),
                                   fraction of sequences outside the band (sequence level)
    band/n_seq/<label>             band_n_seq[b]: sequences counted for acceptance in the bin (which
                                   bins are populated enough to judge flatness)
    band/out_frac, band/tok_out_frac, band/n_seq
                                   out-of-band fraction over all bins (sequences; tokens), and the
                                   number of sequences counted for acceptance (omitted when 0)
    fairness/lre, fairness/lre_w, fairness/q_bar, fairness/n_bins
                                   the paper's LRE: lre.length_fairness over bins with upper edge
                                   > lre_min_len, q_b = band_in[b] / band_n_seq[b]
    clip/seq_frac/<label>          frac_any[b] / n_seq[b]      (sequence-level binding-clip fraction)
    clip/tok_frac/<label>          tok_any[b] / n_tok[b]       (token-level binding-clip fraction)
    clip/seq_frac_{upper,lower,dual,cap}/<label>
    clip/seq_frac, clip/tok_frac, clip/seq_frac_{upper,lower,dual,cap}, clip/tok_frac_{upper,lower,dual,cap}
                                   the same over all bins (omitted when no sequence was seen)
    fairness/binding_lre, fairness/binding_lre_w, fairness/binding_q_bar, fairness/binding_n_bins
                                   the same LRE formulas on the binding clips, q_b = 1 - frac_any/n_seq
"""
from __future__ import annotations

from typing import Dict, Optional

import numpy as np
import torch
from torch import Tensor

from fspo.diagnostics._base import DiagnosticMetric
from fspo.diagnostics.bins import LengthBins, check_finite, check_lengths
from fspo.diagnostics.lre import length_fairness

KINDS = ("upper", "lower", "dual", "any", "cap")


def _check_mask(name: str, x: Tensor, shape, device) -> Tensor:
    x = torch.as_tensor(x).to(device)
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)} like response_mask, got {tuple(x.shape)}")
    return x.bool()


class ClipFractionByLength(DiagnosticMetric):
    """Binding-clip fractions and the paper's acceptance per length bin, LRE / LRE_w (module docstring).

    ``update(lengths, response_mask, clip_upper, clip_lower, clip_dual, advantages, in_band=None,
    clip_cap=None, acceptance=True)``: ``lengths`` [B] (or None: taken as ``response_mask.sum(-1)``;
    if given it must equal it), ``response_mask`` [B, T] 0/1, masks [B, T] bool (ANDed with the
    mask), ``advantages`` [B] or [B, T] (token-broadcast; per-sequence |A_i| is then the masked
    token mean of |A|). ``in_band`` None or ``acceptance=False`` leaves the acceptance states
    (``band/*``, ``fairness/*``) untouched; ``clip_cap`` None counts no cap. B = 0 is a no-op.
    LRE_w uses sum |A_i| per bin as the gradient-norm proxy (see lre.py).
    """

    def __init__(self, bins: LengthBins, lre_min_len: float = 0, **kwargs) -> None:
        super().__init__(**kwargs)
        if not isinstance(bins, LengthBins):
            raise ValueError(f"ClipFractionByLength: bins must be a LengthBins, got {type(bins).__name__}")
        if lre_min_len < 0:
            raise ValueError(f"ClipFractionByLength: lre_min_len must be >= 0, got {lre_min_len}")
        self.bins = bins
        self.lre_min_len = lre_min_len
        self.last_per_bin: Optional[Dict[str, np.ndarray]] = None
        nb = bins.n_bins
        self.add_state("n_seq", torch.zeros(nb, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("n_tok", torch.zeros(nb, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("len_sum", torch.zeros(nb, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("abs_adv", torch.zeros(nb, dtype=torch.float64), dist_reduce_fx="sum")
        for k in KINDS:
            self.add_state(f"frac_{k}", torch.zeros(nb, dtype=torch.float64), dist_reduce_fx="sum")
            self.add_state(f"tok_{k}", torch.zeros(nb, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("band_n_seq", torch.zeros(nb, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("band_n_tok", torch.zeros(nb, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("band_abs_adv", torch.zeros(nb, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("band_in", torch.zeros(nb, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("band_in_tok", torch.zeros(nb, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, lengths: Optional[Tensor], response_mask: Tensor, clip_upper: Tensor,
               clip_lower: Tensor, clip_dual: Tensor, advantages: Tensor, in_band: Optional[Tensor] = None,
               clip_cap: Optional[Tensor] = None, acceptance: bool = True) -> None:
        """Add one (micro-)batch; see the class docstring for shapes."""
        dev = self.n_seq.device
        m = torch.as_tensor(response_mask).to(dev)
        if m.dim() != 2:
            raise ValueError(f"response_mask must have shape [B, T], got {tuple(m.shape)}")
        mb = m.bool()
        mask_len = mb.sum(-1)
        if lengths is None:
            lengths = mask_len
        lengths = check_lengths(lengths).to(dev)
        if lengths.shape[0] != m.shape[0]:
            raise ValueError(f"lengths has {lengths.shape[0]} rows but response_mask has {m.shape[0]}")
        if lengths.numel() and not torch.equal(lengths, mask_len.long()):
            raise ValueError("lengths must equal response_mask.sum(-1); pass lengths=None to derive them")
        masks = {
            "upper": _check_mask("clip_upper", clip_upper, m.shape, dev) & mb,
            "lower": _check_mask("clip_lower", clip_lower, m.shape, dev) & mb,
            "dual": _check_mask("clip_dual", clip_dual, m.shape, dev) & mb,
        }
        masks["any"] = masks["upper"] | masks["lower"] | masks["dual"]
        masks["cap"] = (torch.zeros_like(mb) if clip_cap is None
                        else _check_mask("clip_cap", clip_cap, m.shape, dev) & mb)
        band = None
        if in_band is not None and acceptance:
            band = _check_mask("in_band", in_band, m.shape, dev) & mb
        adv = torch.as_tensor(advantages).to(dev)
        check_finite("advantages", adv, "check the advantage estimator (all-equal rewards with std normalisation?)")
        if adv.dim() == 2 and tuple(adv.shape) == tuple(m.shape):
            abs_a = (adv.double().abs() * mb).sum(-1) / lengths.clamp_min(1).double()
        elif tuple(adv.shape) == (m.shape[0],):
            abs_a = adv.double().abs()
        else:
            raise ValueError(f"advantages must have shape [B] or [B, T]={tuple(m.shape)}, got {tuple(adv.shape)}")
        if m.shape[0] == 0:
            return
        idx = self.bins.index(lengths)
        keep = idx >= 0
        idx, L = idx[keep], lengths[keep]
        Ld = L.double()
        ones = torch.ones_like(idx)
        self.n_seq.index_add_(0, idx, ones)
        self.n_tok.index_add_(0, idx, L)
        self.len_sum.index_add_(0, idx, Ld)
        self.abs_adv.index_add_(0, idx, abs_a[keep].to(self.abs_adv))
        for k in KINDS:
            c = masks[k].sum(-1)[keep]
            getattr(self, f"tok_{k}").index_add_(0, idx, c.long())
            getattr(self, f"frac_{k}").index_add_(0, idx, c.double() / Ld)
        if band is not None:
            c = band.sum(-1)[keep]
            self.band_n_seq.index_add_(0, idx, ones)
            self.band_n_tok.index_add_(0, idx, L)
            self.band_abs_adv.index_add_(0, idx, abs_a[keep].to(self.band_abs_adv))
            self.band_in.index_add_(0, idx, c.double() / Ld)
            self.band_in_tok.index_add_(0, idx, c.long())

    def compute(self) -> Dict[str, float]:
        """Flat dict of floats (names in the module docstring)."""
        out: Dict[str, float] = {}
        n_seq, n_tok = self.n_seq.double(), self.n_tok.double()
        labels = self.bins.labels
        names = {"any": "", "upper": "_upper", "lower": "_lower", "dual": "_dual", "cap": "_cap"}
        band_n = self.band_n_seq.double()
        band_out = band_n - self.band_in  # per-bin sum of out-of-band fractions
        for b in torch.nonzero(self.band_n_seq > 0).flatten().tolist():
            out[f"band/out_frac/{labels[b]}"] = float(band_out[b] / band_n[b])
            out[f"band/n_seq/{labels[b]}"] = float(band_n[b])
        NB = float(band_n.sum())
        if NB > 0:
            out["band/out_frac"] = float(band_out.sum()) / NB
            band_tok = float(self.band_n_tok.sum())
            out["band/tok_out_frac"] = (band_tok - float(self.band_in_tok.sum())) / band_tok
            out["band/n_seq"] = NB
        out.update(length_fairness(self.band_n_seq, band_out, self.band_abs_adv, self.bins, self.lre_min_len,
                                   prefix="fairness/"))
        for b in torch.nonzero(self.n_seq > 0).flatten().tolist():
            out[f"clip/seq_frac/{labels[b]}"] = float(self.frac_any[b] / n_seq[b])
            out[f"clip/tok_frac/{labels[b]}"] = float(self.tok_any[b] / n_tok[b])
            for k in ("upper", "lower", "dual", "cap"):
                out[f"clip/seq_frac{names[k]}/{labels[b]}"] = float(getattr(self, f"frac_{k}")[b] / n_seq[b])
        N, T = float(n_seq.sum()), float(n_tok.sum())
        if N > 0:
            for k in KINDS:
                out[f"clip/seq_frac{names[k]}"] = float(getattr(self, f"frac_{k}").sum()) / N
                out[f"clip/tok_frac{names[k]}"] = float(getattr(self, f"tok_{k}").sum()) / T
        out.update(length_fairness(self.n_seq, self.frac_any, self.abs_adv, self.bins, self.lre_min_len,
                                   prefix="fairness/binding_"))
        self.last_per_bin = self.per_bin()  # synced here: compute() runs inside torchmetrics' sync
        return out

    def reset(self) -> None:
        """Zero every state and forget the per-bin arrays cached by the last `compute()`."""
        super().reset()
        self.last_per_bin = None

    def per_bin(self) -> Dict[str, np.ndarray]:
        """Per-bin arrays of the current states (NaN where a bin is empty).

        Binding clips over every counted sequence: ``count``, ``mean_len``, ``seq_frac``,
        ``tok_frac``. Acceptance over the sequences counted for it: ``band_count``,
        ``band_mean_len``, ``out_frac`` (the paper's c(L) = 1 - q(L)).
        Called by `compute()` (synced across ranks) and cached as ``last_per_bin`` for plots, so
        plotting needs no collective call.
        """
        n = self.n_seq.double().cpu().numpy()
        nb = self.band_n_seq.double().cpu().numpy()
        with np.errstate(invalid="ignore", divide="ignore"):
            return {
                "count": n,
                "mean_len": self.len_sum.cpu().numpy() / n,
                "seq_frac": self.frac_any.cpu().numpy() / n,
                "tok_frac": self.tok_any.double().cpu().numpy() / self.n_tok.double().cpu().numpy(),
                "band_count": nb,
                "band_mean_len": self.band_n_tok.double().cpu().numpy() / nb,
                "out_frac": (nb - self.band_in.cpu().numpy()) / nb,
            }
