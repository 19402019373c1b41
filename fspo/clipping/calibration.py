"""Band calibrators: std(S_L) measured per length instead of assumed sigma sqrt(L), so that
P(|S_L - mu_L| > z scale(L)) = 2 Phi(-z) at every L (Gaussian S_L, any law in L); fspo.py builds the band
mu_L +- z scale(L) and owns z and mu.

* Per geometric length bin k (``bins_per_octave``, overflow [max_len, inf)), over r = S - mu_L with L > 0 and
  r finite: M_k = (n_k, sum log L, sum r^2, sum r^2 / L), float64, all-reduced (exact across ranks).
* Decayed sums, M <- (1 - alpha) M + batch sums: well defined for bins seeing 0-5 sequences per batch, and n_k
  stays a (decayed) count for ``min_count``. Second moment about mu_L: a drift mismatch m costs O(m^4).
* Warm start: without a bin of min_count sequences, the sqrt law sigma_s sqrt(L), sigma_s^2 = sum r^2 / L /
  sum n (``sigma0`` before min_count sequences in all).
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from fspo.clipping._common import check_positive

_N, _LOGL, _R2, _R2L = range(4)  # columns of the moments buffer
_TINY_VAR = 1e-24  # floor on a bin's mean r^2 (std 1e-12): all-zero residuals keep log std finite


def geometric_edges(bins_per_octave: int = 2, max_len: int = 32768) -> list:
    """Integer edges ceil(2^(k / bins_per_octave)) <= max_len, deduplicated, and max_len."""
    top = int(math.floor(bins_per_octave * math.log2(max_len) + 1e-9))
    return sorted({math.ceil(2.0 ** (k / bins_per_octave) - 1e-9) for k in range(top + 1)} | {max_len})


class _MomentBand(torch.nn.Module):
    """Shared state and update of the calibrators. Settings: ``alpha`` in (0, 1], ``sigma0`` > 0, ``min_count`` >= 1,
    ``bins_per_octave`` >= 1 and ``max_len`` >= 2 (ints)."""

    gamma_min, gamma_max = 0.0, 1.5

    def __init__(self, alpha: float = 0.05, sigma0: float = 0.03, min_count: float = 32.0,
                 bins_per_octave: int = 2, max_len: int = 32768) -> None:
        super().__init__()
        own = type(self).__name__
        if not 0.0 < float(alpha) <= 1.0:
            raise ValueError(f"{own}: alpha must be in (0, 1], got {alpha!r}")
        self.alpha = float(alpha)
        self.sigma0 = check_positive(own, "sigma0", sigma0)
        if not (math.isfinite(float(min_count)) and float(min_count) >= 1.0):
            raise ValueError(f"{own}: min_count must be >= 1 (sequences), got {min_count!r}")
        self.min_count = float(min_count)
        for name, v, lo in (("bins_per_octave", bins_per_octave, 1), ("max_len", max_len, 2)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{own}: {name} must be an int >= {lo}, got {v!r}")
        self.edges = geometric_edges(bins_per_octave, max_len)
        self.labels = [f"len_{lo:05d}_{hi:05d}" for lo, hi in zip(self.edges, self.edges[1:])]
        self.labels.append(f"len_{self.edges[-1]:05d}_inf")  # overflow bin
        self.register_buffer("moments", torch.zeros(len(self.edges), 4, dtype=torch.float64))

    def _apply(self, fn, recurse=True):
        """Device moves apply; dtype casts do not: the float64 state stays float64."""
        keep = {k: b for k, b in self._buffers.items() if b is not None and b.dtype == torch.float64}
        out = super()._apply(fn, recurse)
        for k, b in keep.items():
            if self._buffers[k].dtype != b.dtype:
                self._buffers[k] = b.to(self._buffers[k].device)
        return out

    @torch.no_grad()
    def observe(self, seq_log_ratio: Tensor, lengths: Tensor, mu: Optional[Tensor] = None) -> None:
        """M <- (1 - alpha) M + the batch's (1, log L, r^2, r^2 / L) per bin over all ranks, r = S - mu (None: 0).
        Rows with L < 1 or non-finite L or r are ignored; a batch with none on any rank changes nothing."""
        dev = self.moments.device
        s = torch.as_tensor(seq_log_ratio).detach().to(dev, torch.float64).reshape(-1)
        length = torch.as_tensor(lengths).detach().to(dev, torch.float64).reshape(-1)
        if s.shape != length.shape:
            raise ValueError(f"{type(self).__name__}.observe: seq_log_ratio shape {tuple(s.shape)} "
                             f"does not match lengths shape {tuple(length.shape)}")
        r = s if mu is None else s - torch.as_tensor(mu).detach().to(dev, torch.float64).reshape(-1)
        edges = torch.tensor(self.edges, dtype=torch.float64, device=dev)
        idx = torch.bucketize(length.floor(), edges, right=True) - 1
        ok = (length >= 1) & (length < math.inf) & torch.isfinite(r)
        r2, one = torch.where(ok, r, 0.0).square(), torch.where(ok, length, 1.0)
        cols = torch.stack([ok.double(), one.log(), r2, r2 / one], dim=1)
        batch = torch.zeros_like(self.moments).index_add_(0, torch.where(ok, idx, 0), cols)
        extra = self._extra_sums(r, length, torch.where(ok, idx, 0), ok)
        if dist.is_available() and dist.is_initialized():
            if extra is None:
                dist.all_reduce(batch)
            else:  # one collective for both states
                flat = torch.cat([batch.reshape(-1), extra.reshape(-1)])
                dist.all_reduce(flat)
                batch, extra = flat[:batch.numel()].view_as(batch), flat[batch.numel():].view_as(extra)
        seen = batch[:, _N].sum() > 0
        self.moments.copy_(torch.where(seen, (1.0 - self.alpha) * self.moments + batch, self.moments))
        if extra is not None:
            self._update_extra(extra, seen)

    def _extra_sums(self, r: Tensor, length: Tensor, idx: Tensor, ok: Tensor) -> Optional[Tensor]:
        """Further per-batch sums of a subclass, reduced with the moments; None: none."""
        return None

    def _update_extra(self, batch: Tensor, seen: Tensor) -> None:
        """Fold the reduced ``_extra_sums`` into the subclass's state (``seen``: some rank had a row)."""

    def _bins(self) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        """Per bin: populated (n >= min_count), x = mean log L, y = log sqrt(mean r^2), n (float64)."""
        n = self.moments[:, _N]
        safe = torch.where(n > 0, n, 1.0)
        x = self.moments[:, _LOGL] / safe
        y = 0.5 * (self.moments[:, _R2] / safe).clamp(min=_TINY_VAR).log()
        return n >= self.min_count, x, y, n

    def sigma_sqrt(self) -> Tensor:
        """The sqrt-law sigma: sqrt(sum r^2 / L / sum n), sigma0 before min_count."""
        tot = self.moments.sum(0)
        est = (tot[_R2L] / tot[_N].clamp(min=1.0)).clamp(min=_TINY_VAR).sqrt()
        return torch.where(tot[_N] >= self.min_count, est, torch.full_like(est, self.sigma0))

    def fit(self) -> Tuple[Tensor, Tensor]:
        """(sigma, gamma) of std(S_L) = sigma L^gamma: least squares of log std_k on mean log L_k over populated bins,
        weights n_k, gamma clamped to [gamma_min, gamma_max]; fewer than 2 bins: (sigma_sqrt(), 0.5)."""
        pop, x, y, n = self._bins()
        w = torch.where(pop, n, 0.0)
        sw = w.sum().clamp(min=1e-300)
        xb, yb = (w * x).sum() / sw, (w * y).sum() / sw
        sxx, sxy = (w * (x - xb).square()).sum(), (w * (x - xb) * (y - yb)).sum()
        ok = (pop.sum() >= 2) & (sxx > 0)
        gamma = torch.where(ok, (sxy / sxx.clamp(min=1e-300)).clamp(self.gamma_min, self.gamma_max),
                            torch.full_like(sxx, 0.5))
        return torch.where(ok, torch.exp(yb - gamma * xb), self.sigma_sqrt()), gamma

    @staticmethod
    def _lengths(lengths: Tensor, dev: torch.device) -> Tensor:
        return torch.as_tensor(lengths).detach().to(dev, torch.float64)

    def metrics(self) -> Dict[str, float]:
        """clip/band_sigma, clip/band_gamma, clip/band_sigma_sqrt, clip/band_count, clip/band_bins."""
        sigma, gamma = self.fit()
        pop, _, _, n = self._bins()
        return {"clip/band_sigma": float(sigma), "clip/band_gamma": float(gamma),
                "clip/band_sigma_sqrt": float(self.sigma_sqrt()), "clip/band_count": float(n.sum()),
                "clip/band_bins": float(pop.sum())}

    def extra_repr(self) -> str:
        return (f"alpha={self.alpha}, sigma0={self.sigma0}, min_count={self.min_count}, "
                f"bins={len(self.edges)}")


class PowerLawBand(_MomentBand):
    """scale(L) = sigma L^gamma from `fit` (0 at L = 0). gamma in [``gamma_min``, ``gamma_max``] = [0, 1.5]: [0, 1]
    spans stationary token processes, and the cap bounds how far a noisy fit can blow the extrapolated band up."""

    def __init__(self, alpha: float = 0.05, sigma0: float = 0.03, min_count: float = 32.0,
                 bins_per_octave: int = 2, max_len: int = 32768, gamma_min: float = 0.0,
                 gamma_max: float = 1.5) -> None:
        super().__init__(alpha, sigma0, min_count, bins_per_octave, max_len)
        if not (math.isfinite(float(gamma_min)) and math.isfinite(float(gamma_max))
                and float(gamma_min) <= 0.5 <= float(gamma_max)):
            raise ValueError(f"{type(self).__name__}: gamma_min <= 0.5 <= gamma_max must hold (finite), "
                             f"got gamma_min={gamma_min!r}, gamma_max={gamma_max!r}")
        self.gamma_min, self.gamma_max = float(gamma_min), float(gamma_max)

    def scale(self, lengths: Tensor) -> Tensor:
        """sigma L^gamma per sequence, float32 [B] on the device of ``lengths``; 0 where L <= 0."""
        L = self._lengths(lengths, self.moments.device)
        sigma, gamma = self.fit()
        out = torch.where(L > 0, sigma * L.clamp(min=1e-300).pow(gamma), 0.0)
        return out.to(torch.as_tensor(lengths).device, torch.float32)


class PerBinBand(_MomentBand):
    """scale(L) = the bins' own std, no law assumed: linear in (mean log L, log std) between populated bins, the
    sqrt law from the end bins beyond them, sigma_sqrt() sqrt(L) with no populated bin."""

    def scale(self, lengths: Tensor) -> Tensor:
        """std_hat(L) per sequence, float32 [B] on the device of ``lengths``; 0 where L <= 0."""
        L = self._lengths(lengths, self.moments.device)
        pop, x, y, _ = self._bins()
        xs, ys = x[pop], y[pop]
        q = L.clamp(min=1e-300).log()
        if xs.numel() == 0:
            out = self.sigma_sqrt() * L.clamp(min=0.0).sqrt()
        else:
            if xs.numel() >= 2:
                i = torch.searchsorted(xs, q).clamp(1, xs.numel() - 1)
                t = (q - xs[i - 1]) / (xs[i] - xs[i - 1]).clamp(min=1e-12)
                yq = ys[i - 1] + t.clamp(0.0, 1.0) * (ys[i] - ys[i - 1])
            else:
                yq = ys[0].expand_as(q)
            yq = torch.where(q < xs[0], ys[0] + 0.5 * (q - xs[0]), yq)
            yq = torch.where(q > xs[-1], ys[-1] + 0.5 * (q - xs[-1]), yq)
            out = yq.exp()
        out = torch.where(L > 0, out, 0.0)
        return out.to(torch.as_tensor(lengths).device, torch.float32)

    def metrics(self) -> Dict[str, float]:
        """As the base, plus clip/band_std/<bin label> for each populated bin."""
        out = super().metrics()
        pop, _, y, _ = self._bins()
        for k in torch.nonzero(pop).flatten().tolist():
            out[f"clip/band_std/{self.labels[k]}"] = math.exp(float(y[k]))
        return out


#: ``clip.band`` name -> calibrator class (fspo.py wires them in).
CALIBRATORS = {"power": PowerLawBand, "per_bin": PerBinBand}
