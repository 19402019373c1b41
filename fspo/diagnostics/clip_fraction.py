"""Clip fractions, the paper's acceptance rate and the LRE by response length, as a torchmetrics `Metric` with
sum-reduced states (exact for any split over ranks and micro-batches). Two events per sequence (base.py):
acceptance (``in_band``, rate q(L); c(L) = 1 - q(L) as in theory.py) gives ``band/*`` and ``fairness/*``;
binding clips give ``clip/*`` and ``fairness/binding_*``; the float-safety cap is counted apart
(``clip/seq_frac_cap``), not in ``any = upper | lower | dual``. Per bin, a sequence counts its share of tokens
f_ik = (sum_t clip_k[i, t] m_it) / L_i (0 or 1 for sequence rules) and g_i in band. The acceptance states
count only batches updated with ``acceptance=True`` (`FairnessMetrics` skips on-policy mini-batches), so
``band/*`` may cover fewer sequences than ``clip/*``. `compute()` (per-bin keys for non-empty bins; never NaN):
``band/out_frac[/<bin>]``, ``band/tok_out_frac``, ``band/n_seq[/<bin>]``, ``fairness/{lre, lre_w, q_bar,
n_bins}`` (bins with upper edge > lre_min_len), ``clip/seq_frac[_{upper,lower,dual,cap}][/<bin>]``,
``clip/tok_frac[/<bin>]``, ``clip/tok_frac_{upper,lower,dual,cap}``, ``fairness/binding_*``.
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
    """Binding-clip fractions and acceptance per length bin, LRE / LRE_w (module docstring).

    ``update(lengths, response_mask, clip_upper, clip_lower, clip_dual, advantages, in_band=None, clip_cap=None,
    acceptance=True)``: ``lengths`` [B] equal to ``response_mask.sum(-1)`` (None: derived), masks [B, T] (ANDed
    with the mask), ``advantages`` [B] or [B, T] (then |A_i| is the masked mean of |A|). ``in_band`` None or
    ``acceptance=False`` leaves the acceptance states alone. B = 0 is a no-op.
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
        i64, f64 = torch.long, torch.float64
        states = [("n_seq", i64), ("n_tok", i64), ("len_sum", f64), ("abs_adv", f64)]
        states += [s for k in KINDS for s in ((f"frac_{k}", f64), (f"tok_{k}", i64))]
        states += [("band_n_seq", i64), ("band_n_tok", i64), ("band_abs_adv", f64), ("band_in", f64),
                   ("band_in_tok", i64)]
        for name, dtype in states:
            self.add_state(name, torch.zeros(bins.n_bins, dtype=dtype), dist_reduce_fx="sum")

    def update(self, lengths: Optional[Tensor], response_mask: Tensor, clip_upper: Tensor,
               clip_lower: Tensor, clip_dual: Tensor, advantages: Tensor, in_band: Optional[Tensor] = None,
               clip_cap: Optional[Tensor] = None, acceptance: bool = True) -> None:
        """Add one (micro-)batch; shapes in the class docstring."""
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
        masks = {k: _check_mask(f"clip_{k}", v, m.shape, dev) & mb
                 for k, v in (("upper", clip_upper), ("lower", clip_lower), ("dual", clip_dual))}
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
        """Zero every state and forget the cached per-bin arrays."""
        super().reset()
        self.last_per_bin = None

    def per_bin(self) -> Dict[str, np.ndarray]:
        """Per-bin arrays (NaN where empty): ``count``, ``mean_len``, ``seq_frac``, ``tok_frac`` (binding clips);
        ``band_count``, ``band_mean_len``, ``out_frac`` (acceptance). Cached as ``last_per_bin`` by `compute()`
        (synced), so plotting needs no collective."""
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
