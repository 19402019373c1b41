"""Band calibrators: the std of the sequence log-ratio at each length, measured instead of assumed.

Owns: `PowerLawBand` and `PerBinBand` (running per-length-bin moments kept as a float64 buffer, so
they land in checkpoints; their update in `observe`, exact across ranks; the scale std(S_L) the band
is built from; their metrics) and `CALIBRATORS` (name -> class, for ``clip.band=power|per_bin``).
Leaves out: the band, the clip and the loss (fspo.py builds mu_L +- z scale(L)), z,
the drift mu_L (the caller passes the one in effect) and when to observe (fspo/update/module.py: once per
optimizer step, not on on-policy mini-batches, where S = 0 exactly).

Why: the paper's band mu_L +- z sigma sqrt(L) clips with probability 2 Phi(-z) at every L only if
S_L ~ N(mu_L, sigma^2 L). Where std(S_L) grows like L^gamma with gamma > 1/2 the sqrt band clips
more and more of the long sequences. With scale(L) = std(S_L - mu_L) measured per length,
P(|S_L - mu_L| > z scale(L)) = 2 Phi(-z) again for every L (Gaussian S_L, any law in L).

Interface (both classes; the caller owns z and mu):
    observe(seq_log_ratio [B], lengths [B], mu [B] | None) -> None   every rank, once per step
    scale(lengths [B]) -> float32 [B]   0 at L = 0; finite and > 0 for any L > 0 (e.g. 32,768)
    fit() -> (sigma, gamma)             weighted power-law fit over the populated bins (tensors)
    metrics() -> Dict[str, float]       clip/band_* scalars, MLflow-safe names

Estimator choices:
* State per length bin k (residual r = S - mu_L, sequences with L > 0 and finite r only):
  M_k = (n_k, sum log L, sum r^2, sum r^2 / L). Sum-reduced, so one all_reduce of the batch's
  sums makes every rank apply the identical update, equal (up to float64 summation order) to the
  update one process computes from the whole batch.
* Forgetting by decayed sums, M <- (1 - alpha) M + batch sums (a batch with no sequence on any rank
  leaves M unchanged). Every estimate is a ratio of sums, i.e. a weighted mean over past
  sequences with weight (1 - alpha)^age: it converges for stationary data (effective sample about
  (2 - alpha) / alpha batches) and forgets a policy's batches geometrically. Unlike an EMA of
  per-batch statistics it needs no per-batch estimate, which a bin seeing 0-5 sequences per batch
  does not have, and n_k stays a count of (decayed) sequences, so ``min_count`` means sequences.
* Second moment about mu_L, not the variance about the bin mean: for r ~ N(m, v) and small m,
  P(|r| > z sqrt(v + m^2)) = 2 Phi(-z) + O(m^4), so a drift mismatch m leaves the clip fraction on
  target to second order; with the right drift (m = 0) it is the std.
* Geometric bins, ``bins_per_octave`` per doubling (edges ceil(2^(k / bpo)), overflow [max_len, inf)):
  L spans 10..20,000, so equal widths would put all short sequences in one bin, and a std growing as a
  power of L is a straight line in log L. Each bin sits at its data's mean log L; pooling a bin
  of width factor w = 2^(1 / bpo) overstates std by sqrt(sinh(g) / g) - 1, g = gamma ln w: 0.6 % for
  gamma = 0.8 at 2 bins per octave (clip fraction -0.003 at z = 1). Bins and labels follow
  fspo.diagnostics.bins.LengthBins ([e_k, e_k+1), len_00016_00023), not imported: that package
  pulls in torchmetrics (seconds per process), which fspo.clipping does not need.
* Warm start: a bin counts once n_k >= ``min_count``. Without populated bins the scale is the
  paper's sqrt law sigma_s sqrt(L), sigma_s = sqrt(sum r^2 / L / sum n) (the paper's fit, RMS of
  S / sqrt(L)) once min_count sequences were seen in all, ``sigma0`` before.
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from fspo.clipping._common import check_positive

__all__ = ["PowerLawBand", "PerBinBand", "CALIBRATORS", "geometric_edges"]

_N, _LOGL, _R2, _R2L = range(4)  # columns of the moments buffer
_TINY_VAR = 1e-24  # floor on a bin's mean r^2 (std 1e-12): all-zero residuals keep log std finite


def geometric_edges(bins_per_octave: int = 2, max_len: int = 32768) -> list:
    """Integer edges ceil(2^(k / bins_per_octave)) <= max_len, deduplicated, and max_len."""
    top = int(math.floor(bins_per_octave * math.log2(max_len) + 1e-9))
    return sorted({math.ceil(2.0 ** (k / bins_per_octave) - 1e-9) for k in range(top + 1)} | {max_len})


class _MomentBand(torch.nn.Module):
    """Shared state and update of the calibrators (see the module docstring).

    Settings: ``alpha`` in (0, 1] (forgetting rate), ``sigma0`` > 0 (warm-start sqrt-law sigma),
    ``min_count`` >= 1 (decayed sequences for a bin to count), ``bins_per_octave`` >= 1 and
    ``max_len`` >= 2 (ints: the geometric bins).
    """

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
        """Device moves apply; dtype casts (``.to(torch.bfloat16)``) do not: the sums stay float64."""
        keep = self.moments
        out = super()._apply(fn, recurse)
        if self.moments.dtype != keep.dtype:
            self.moments = keep.to(self.moments.device)
        return out

    @torch.no_grad()
    def observe(self, seq_log_ratio: Tensor, lengths: Tensor, mu: Optional[Tensor] = None) -> None:
        """M <- (1 - alpha) M + sum over the batch (all ranks) of (1, log L, r^2, r^2 / L) per bin.

        r = S - mu (mu: the drift in effect, [B] or scalar; None = 0). Sequences with L < 1, a
        non-finite L or a non-finite r are ignored (rows of zeros); a batch with none on any rank
        leaves the state unchanged. Call on every rank (it all-reduces when torch.distributed is
        initialised), also with an empty share.
        """
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
        """Further per-batch sums a subclass keeps beside the moments (float64, reduced with them in
        `observe`'s single all_reduce); ``idx`` is each sequence's length bin, ``ok`` the rows that
        count. None: no further state."""
        return None

    def _update_extra(self, batch: Tensor, seen: Tensor) -> None:
        """Fold the all-reduced ``_extra_sums`` into the subclass's state (``seen``: the batch had a
        sequence on some rank)."""

    def _bins(self) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        """Per bin: populated (n >= min_count), x = mean log L, y = log sqrt(mean r^2), n (float64)."""
        n = self.moments[:, _N]
        safe = torch.where(n > 0, n, 1.0)
        x = self.moments[:, _LOGL] / safe
        y = 0.5 * (self.moments[:, _R2] / safe).clamp(min=_TINY_VAR).log()
        return n >= self.min_count, x, y, n

    def sigma_sqrt(self) -> Tensor:
        """The sqrt-law sigma: sqrt(sum r^2 / L / sum n) over all bins, sigma0 before min_count."""
        tot = self.moments.sum(0)
        est = (tot[_R2L] / tot[_N].clamp(min=1.0)).clamp(min=_TINY_VAR).sqrt()
        return torch.where(tot[_N] >= self.min_count, est, torch.full_like(est, self.sigma0))

    def fit(self) -> Tuple[Tensor, Tensor]:
        """(sigma, gamma) of std(S_L) = sigma L^gamma: least squares of y_k = log std_k on
        x_k = mean log L_k over populated bins, weights n_k (var(log std_hat) ~ 1 / (2 n) for
        Gaussian S), gamma = S_xy / S_xx clamped to [gamma_min, gamma_max], log sigma = y_bar -
        gamma x_bar. Fewer than 2 populated bins: (sigma_sqrt(), 0.5), the paper's law."""
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
        """clip/band_sigma, clip/band_gamma (the power-law fit; PerBinBand: for monitoring only,
        with the default clamp), clip/band_sigma_sqrt (paper law),
        clip/band_count (decayed sequences), clip/band_bins (populated bins)."""
        sigma, gamma = self.fit()
        pop, _, _, n = self._bins()
        return {"clip/band_sigma": float(sigma), "clip/band_gamma": float(gamma),
                "clip/band_sigma_sqrt": float(self.sigma_sqrt()), "clip/band_count": float(n.sum()),
                "clip/band_bins": float(pop.sum())}

    def extra_repr(self) -> str:
        return (f"alpha={self.alpha}, sigma0={self.sigma0}, min_count={self.min_count}, "
                f"bins={len(self.edges)}")


class PowerLawBand(_MomentBand):
    """scale(L) = sigma L^gamma, (sigma, gamma) from `fit` on the running bins; 0 at L = 0.

    gamma is clamped to [``gamma_min``, ``gamma_max``] = [0, 1.5] by default: gamma in [0, 1] spans
    every stationary token process (1/2 independent increments, 1 all tokens moving together);
    above 1 the per-token spread itself grows with L (seen on the tiny arithmetic task), and the clamp
    bounds how far a noisy fit from two close bins can blow the band up when the law is
    extrapolated beyond the observed lengths (2,000^1.5 = 9e4 already). A negative gamma
    (longer sequences less spread) has no token-sum reading. Where the true gamma lies outside the
    range, the clamped law pivots at the data's (n-weighted) mean log L: right there, drifting away
    from it (less than the sqrt band where gamma > 1.5).
    """

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
    """scale(L) = std_hat(L) from the bins themselves, no law assumed inside the data.

    With (x_k, y_k) = (mean log L, log std_hat) of the populated bins (n_k >= min_count), at
    q = log L: linear interpolation in (x, y) between the neighbouring populated bins (empty or
    thin bins inside the range are bridged, not replaced by the sqrt law, which would bring back
    the bias this removes); beyond the end bins the sqrt law from the nearest one,
    y = y_end + (q - x_end) / 2; no populated bin: sigma_sqrt() sqrt(L) (sigma0 before min_count
    sequences). Noisier than `PowerLawBand` (each bin has its own sample) but right for any shape.
    """

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
        """As the base, plus clip/band_std/len_XXXXX_YYYYY (std_hat) for each populated bin."""
        out = super().metrics()
        pop, _, y, _ = self._bins()
        for k in torch.nonzero(pop).flatten().tolist():
            out[f"clip/band_std/{self.labels[k]}"] = math.exp(float(y[k]))
        return out


#: ``clip.band`` name -> calibrator class (fspo.py wires them in).
CALIBRATORS = {"power": PowerLawBand, "per_bin": PerBinBand}
