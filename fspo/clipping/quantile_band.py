"""The quantile band: FSPO's half-width set to the observed quantile of |S_L - mu_L| per length bin, so the
out-of-band fraction is 2 Phi(-z) at every length whatever the law of S_L (heavier tails than Gaussian put
less mass beyond z std, and a shape changing with L moves c(L) again).

State: H[k, j] <- (1 - alpha) H[k, j] + the batch's count (all ranks) in length bin k with u = |S - mu_L| /
sqrt(L) in cell j of ``n_u`` log-spaced edges from ``u_min`` to ``u_max`` (cell 0 from 0, the last to inf).
q_k, the erf(z / sqrt 2) quantile of u in bin k (log-linear inside its cell), gives the half-width
b_k = q_k exp(x_k / 2) at the bin's mean log length x_k; the scale is b_k / z, interpolated as `PerBinBand`.
"""
from __future__ import annotations

import math
from typing import Dict, Tuple

import torch
from torch import Tensor

from fspo.clipping._common import check_positive
from fspo.clipping.calibration import PerBinBand


class QuantileBand(PerBinBand):
    """scale(L) = (coverage quantile of |S_L - mu_L|) / z per length bin. Settings as `PerBinBand` plus ``z`` > 0
    (FSPOClip's), ``u_min`` < ``u_max`` (> 0) and ``n_u`` >= 8 cells."""

    needs_z = True  # FSPOClip passes its z (the coverage and the scale depend on it)

    def __init__(self, alpha: float = 0.05, sigma0: float = 0.03, min_count: float = 32.0,
                 bins_per_octave: int = 2, max_len: int = 32768, z: float = 1.0,
                 u_min: float = 1e-5, u_max: float = 10.0, n_u: int = 128) -> None:
        super().__init__(alpha, sigma0, min_count, bins_per_octave, max_len)
        own = type(self).__name__
        self.z = check_positive(own, "z", z)
        self.coverage = math.erf(self.z / math.sqrt(2.0))
        lo, hi = check_positive(own, "u_min", u_min), check_positive(own, "u_max", u_max)
        if not lo < hi:
            raise ValueError(f"{own}: u_min ({u_min!r}) must be < u_max ({u_max!r})")
        if isinstance(n_u, bool) or not isinstance(n_u, int) or n_u < 8:
            raise ValueError(f"{own}: n_u must be an int >= 8, got {n_u!r}")
        # cell j covers [e_j, e_{j+1}); e_0 = 0, e_1 = u_min, ..., e_{n_u - 1} = u_max, e_{n_u} = inf
        inner = torch.logspace(math.log10(lo), math.log10(hi), n_u - 1, dtype=torch.float64)
        self.register_buffer("u_edges", torch.cat([torch.zeros(1, dtype=torch.float64), inner]), persistent=False)
        self.register_buffer("hist", torch.zeros(len(self.edges), n_u, dtype=torch.float64))

    def _extra_sums(self, r: Tensor, length: Tensor, idx: Tensor, ok: Tensor) -> Tensor:
        """This batch's histogram of u per length bin (rows that count only)."""
        u = torch.where(ok, r.abs() / torch.where(ok, length, 1.0).sqrt(), 0.0)
        j = (torch.bucketize(u, self.u_edges, right=True) - 1).clamp(0, self.hist.shape[1] - 1)
        flat = torch.where(ok, idx * self.hist.shape[1] + j, 0)
        batch = torch.zeros(self.hist.numel(), dtype=torch.float64, device=self.hist.device)
        return batch.index_add_(0, flat, ok.double()).view_as(self.hist)

    def _update_extra(self, batch: Tensor, seen: Tensor) -> None:
        """H <- (1 - alpha) H + the batch's histogram; unchanged when no rank had a sequence."""
        self.hist.copy_(torch.where(seen, (1.0 - self.alpha) * self.hist + batch, self.hist))

    def quantiles(self) -> Tensor:
        """The coverage quantile of u per length bin [K] (float64; 0 for an empty bin), log-linear inside its cell
        (linear in [0, u_min); u_max in the last cell)."""
        n = self.hist.sum(1, keepdim=True)
        cum = self.hist.cumsum(1)
        target = self.coverage * n
        j = torch.searchsorted(cum, target).clamp(max=self.hist.shape[1] - 1)  # first cell with cum >= target
        below = torch.where(j > 0, cum.gather(1, (j - 1).clamp(min=0)), torch.zeros_like(target))
        inside = self.hist.gather(1, j)
        t = ((target - below) / inside.clamp(min=1e-300)).clamp(0.0, 1.0)
        e = self.u_edges
        lo = e[j]
        hi = torch.where(j + 1 < e.numel(), e[(j + 1).clamp(max=e.numel() - 1)], e[-1])
        geo = lo.clamp(min=1e-300) * (hi / lo.clamp(min=1e-300)).pow(t)
        q = torch.where(j == 0, t * hi, torch.where(j + 1 < e.numel(), geo, e[-1]))
        return torch.where(n > 0, q, torch.zeros_like(q)).squeeze(1)

    def _bins(self) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        """As the base with y = log(b_k / z), so `PerBinBand.scale` interpolates the quantile band."""
        pop, x, _, n = super()._bins()
        q = self.quantiles().clamp(min=1e-12)
        return pop, x, q.log() + 0.5 * x - math.log(self.z), n

    def metrics(self) -> Dict[str, float]:
        """As `PerBinBand` (clip/band_std/<bin> is b_k / z) plus clip/band_coverage."""
        out = super().metrics()
        out["clip/band_coverage"] = self.coverage
        return out

    def extra_repr(self) -> str:
        return super().extra_repr() + f", z={self.z}, coverage={self.coverage:.4f}, n_u={self.hist.shape[1]}"
