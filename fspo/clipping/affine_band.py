"""The affine-variance band: FSPO's half-width z sqrt(tau^2 + sigma^2 L), for runs where part of the variance of
S_L does not grow with L (std(S_L) flat below L* = tau^2 / sigma^2, where the sqrt band over-clips short
responses; docs/length_law.md). The paper's band is tau^2 = 0.

Fit on the running bins of `_MomentBand`: weighted least squares of m_k = mean r^2 on l_k = exp(mean log L)
over bins with n_k >= min_count, weights n_k / m_k^2, E[r^2 | L] = tau^2 + sigma^2 L; tau^2 >= 0,
sigma^2 >= sigma0^2 / 1e4; fewer than 2 bins: the sqrt law.
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch
from torch import Tensor

from fspo.clipping.calibration import _LOGL, _N, _R2, _MomentBand


class AffineVarianceBand(_MomentBand):
    """scale(L) = sqrt(tau^2 + sigma^2 L) from the running bins; 0 at L = 0."""

    def fit_affine(self) -> Tuple[Tensor, Tensor]:
        """(tau^2, sigma^2) as float64 scalars."""
        n = self.moments[:, _N]
        pop = n >= self.min_count
        safe = torch.where(n > 0, n, 1.0)
        m = (self.moments[:, _R2] / safe).clamp(min=1e-24)
        x = (self.moments[:, _LOGL] / safe).exp()
        w = torch.where(pop, n / m.square(), 0.0)
        s0, s1, s2 = w.sum(), (w * x).sum(), (w * x * x).sum()
        t0, t1 = (w * m).sum(), (w * x * m).sum()
        det = s0 * s2 - s1 * s1
        ok = (pop.sum() >= 2) & (det > 0)
        safe_det = torch.where(ok, det, torch.ones_like(det))
        sigma2 = (s0 * t1 - s1 * t0) / safe_det
        tau2 = (s2 * t0 - s1 * t1) / safe_det
        floor = torch.full_like(sigma2, self.sigma0 ** 2 / 1e4)
        sqrt_law = self.sigma_sqrt().square()
        return (torch.where(ok, tau2.clamp(min=0.0), torch.zeros_like(tau2)),
                torch.where(ok, torch.maximum(sigma2, floor), sqrt_law))

    def scale(self, lengths: Tensor) -> Tensor:
        """sqrt(tau^2 + sigma^2 L), float32 [B] on the device of ``lengths``; 0 where L <= 0."""
        L = self._lengths(lengths, self.moments.device)
        tau2, sigma2 = self.fit_affine()
        out = torch.where(L > 0, (tau2 + sigma2 * L.clamp(min=0.0)).sqrt(), 0.0)
        return out.to(torch.as_tensor(lengths).device, torch.float32)

    def metrics(self) -> Dict[str, float]:
        """As the base, plus clip/band_tau2, clip/band_sigma2, clip/band_l_star."""
        out = super().metrics()
        tau2, sigma2 = self.fit_affine()
        out.update({"clip/band_tau2": float(tau2), "clip/band_sigma2": float(sigma2),
                    "clip/band_l_star": float(tau2 / sigma2)})
        return out
