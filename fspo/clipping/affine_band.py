"""The affine-variance band: FSPO's half-width z sqrt(tau^2 + sigma^2 L), fit on past updates, for runs where
std(S_L) is not sigma sqrt(L) because part of the variance does not grow with L.

Owns: `AffineVarianceBand` (``clip.band=affine``): the running per-length-bin moments of `_MomentBand`
(calibration.py; decayed, checkpointed, exact across ranks) and the weighted least-squares fit of each
bin's mean square of r = S - mu_L on its mean length:  E[r^2 | L] = tau^2 + sigma^2 L. Leaves out: the band
and the loss (fspo.py multiplies the scale by z), when to observe (fspo/update/module.py: after
each optimizer update, so a mini-batch is always judged by a band fit on earlier ones: out of sample).

Why: sequences correlated with the update (siblings of trained rows, shared prompts, the first line's and the
end-of-sequence token's own sensitivity) add a length-independent variance tau^2; then std(S_L) is flat below
L* = tau^2 / sigma^2 and the sqrt(L) band over-clips short responses (measured on arithmetic_law: docs/length_law.md).
With the scale sqrt(tau^2 + sigma^2 L) the out-of-band fraction is 2 Phi(-z) at every L for Gaussian S
whatever L* is; the paper's band is the special case tau^2 = 0.

Fit: over populated bins k (n_k >= min_count) with m_k = mean r^2 and l_k = exp(mean log L) (the bin's
geometric mean length), weights n_k / m_k^2 (the inverse variance of a Gaussian mean square), solve the 2 x 2
normal equations; tau^2 < 0 is clamped to 0 and sigma^2 to >= sigma0^2 / 1e4. Fewer than 2 populated bins: the
sqrt law of the moments (sigma0 before min_count sequences).
"""
from __future__ import annotations

from typing import Dict, Tuple

import torch
from torch import Tensor

from fspo.clipping.calibration import _MomentBand

_N, _LOGL, _R2 = 0, 1, 2


class AffineVarianceBand(_MomentBand):
    """scale(L) = sqrt(tau^2 + sigma^2 L) from the running bins (module docstring); 0 at L = 0."""

    def fit_affine(self) -> Tuple[Tensor, Tensor]:
        """(tau^2, sigma^2) of E[r^2 | L] = tau^2 + sigma^2 L (float64 scalars)."""
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
        """sqrt(tau^2 + sigma^2 L) per sequence, float32 [B] on the device of ``lengths``; 0 where L <= 0."""
        L = self._lengths(lengths, self.moments.device)
        tau2, sigma2 = self.fit_affine()
        out = torch.where(L > 0, (tau2 + sigma2 * L.clamp(min=0.0)).sqrt(), 0.0)
        return out.to(torch.as_tensor(lengths).device, torch.float32)

    def metrics(self) -> Dict[str, float]:
        """As the base, plus clip/band_tau2, clip/band_sigma2 and clip/band_l_star (tau^2 / sigma^2)."""
        out = super().metrics()
        tau2, sigma2 = self.fit_affine()
        out.update({"clip/band_tau2": float(tau2), "clip/band_sigma2": float(sigma2),
                    "clip/band_l_star": float(tau2 / sigma2)})
        return out
