"""The quantile band: FSPO's band set to the observed quantile of |S_L - mu_L| per length bin, so its
out-of-band fraction is 2 Phi(-z) at every length whatever the law of S_L (shape and scale).

Owns: `QuantileBand` (``clip.band=quantile``): a decayed per-length-bin histogram of
u = |S - mu_L| / sqrt(L) (float64 buffer, checkpointed; one all_reduce per update, exact across
ranks), the bin quantile at the coverage 1 - 2 Phi(-z) = erf(z / sqrt 2), and the scale FSPOClip
multiplies by z. Leaves out: the band and the loss (fspo.py), when to observe
(fspo/update/module.py), the moment state and the log-L interpolation it inherits (calibration.py).

Why (measured on data=arithmetic_long, Q-Q R^2 ~0.8): the per-bin std band of `PerBinBand`
is exact for Gaussian S only; heavier tails put less mass beyond z std (0.16-0.18 out of band at
z = 1, not 0.317), and a shape that changes with L makes c(L) move with L again. Matching the
quantile itself removes both. Cost: a histogram per bin (128 x 31 float64, 32 KB) instead of 4
moments, and the quantile of a bin is noisier than its std (it uses only the counts near it).

Estimator:
* u-grid: ``n_u`` log-spaced edges from ``u_min`` to ``u_max`` (u = 0, e.g. exactly on-policy S,
  falls in the first cell; u >= u_max in the last). Resolution: adjacent edges differ by a factor
  (u_max / u_min)^(1 / (n_u - 2)) = 1.13 at the defaults, and the quantile is interpolated
  log-linearly inside its cell.
* State H[k, j] <- (1 - alpha) H[k, j] + this batch's count (all ranks) of sequences in length
  bin k with u in cell j; the same forgetting as the moments (so ``n_k`` = sum_j H[k, j]).
* q_k = the coverage quantile of u in bin k, the half-width at the bin's mean length is
  b_k = q_k exp(x_k / 2) (x_k = mean log L), and the scale handed to FSPOClip is b_k / z (the
  std a Gaussian would need to be clipped at that fraction by z std), interpolated in log L between
  populated bins and extended by the sqrt law beyond them exactly as `PerBinBand`. The warm start
  (no populated bin) is the sqrt law of the moments (``sigma0`` first).
"""
from __future__ import annotations

import math
from typing import Dict, Tuple

import torch
from torch import Tensor

from fspo.clipping._common import check_positive
from fspo.clipping.calibration import PerBinBand

__all__ = ["QuantileBand"]


class QuantileBand(PerBinBand):
    """scale(L) = (coverage quantile of |S_L - mu_L|) / z, per length bin (see the module docstring).

    Settings as `PerBinBand` plus ``z`` > 0 (FSPOClip's, passed by it: the coverage is
    erf(z / sqrt 2)), ``u_min`` < ``u_max`` (> 0, the u-grid's range) and ``n_u`` >= 8 cells.
    """

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

    def _apply(self, fn, recurse=True):
        """As the base: device moves apply, dtype casts leave the float64 state alone."""
        keep = (self.hist, self.u_edges)
        out = super()._apply(fn, recurse)
        if self.hist.dtype != keep[0].dtype:
            self.hist = keep[0].to(self.hist.device)
            self.u_edges = keep[1].to(self.hist.device)
        return out

    def _extra_sums(self, r: Tensor, length: Tensor, idx: Tensor, ok: Tensor) -> Tensor:
        """This batch's histogram of u = |S - mu| / sqrt(L) per length bin (rows that count only);
        `observe` all-reduces it with the moments."""
        u = torch.where(ok, r.abs() / torch.where(ok, length, 1.0).sqrt(), 0.0)
        j = (torch.bucketize(u, self.u_edges, right=True) - 1).clamp(0, self.hist.shape[1] - 1)
        flat = torch.where(ok, idx * self.hist.shape[1] + j, 0)
        batch = torch.zeros(self.hist.numel(), dtype=torch.float64, device=self.hist.device)
        return batch.index_add_(0, flat, ok.double()).view_as(self.hist)

    def _update_extra(self, batch: Tensor, seen: Tensor) -> None:
        """H <- (1 - alpha) H + the batch's histogram (all ranks); unchanged when no rank had a sequence."""
        self.hist.copy_(torch.where(seen, (1.0 - self.alpha) * self.hist + batch, self.hist))

    def quantiles(self) -> Tensor:
        """The coverage quantile of u per length bin [K] (float64; 0 for an empty bin): the cell
        where the cumulative count crosses coverage * n_k, log-linear inside it (linear in the first
        cell [0, u_min); the last cell [u_max, inf) returns u_max)."""
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
        """As the base, with y = log(b_k / z), b_k = q_k exp(x_k / 2) the half-width at the bin's
        mean length: `PerBinBand.scale` then interpolates the quantile band instead of the std."""
        pop, x, _, n = super()._bins()
        q = self.quantiles().clamp(min=1e-12)
        return pop, x, q.log() + 0.5 * x - math.log(self.z), n

    def metrics(self) -> Dict[str, float]:
        """As `PerBinBand` (clip/band_std/<bin> is b_k / z here) plus clip/band_coverage."""
        out = super().metrics()
        out["clip/band_coverage"] = self.coverage
        return out

    def extra_repr(self) -> str:
        return super().extra_repr() + f", z={self.z}, coverage={self.coverage:.4f}, n_u={self.hist.shape[1]}"
