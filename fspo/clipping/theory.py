"""Closed-form clip probabilities c(L) = 1 - q(L) under S_L ~ N(mu L, sigma^2 L) (paper eqs. (1), (2)),
numpy float64 over L; observed as ``band/out_frac/<bin>``. ``parts=True`` returns (upper, lower): a clip
binds only on the side of sign(A), so the binding fraction is about p upper + (1 - p) lower. L = 0 gives 0.

    RLOO  P(S > log(1 + eps_hi)) + P(S < log(1 - eps_lo))
    GSPO  the same for S / L ~ N(mu, sigma^2 / L)
    FSPO  P(S > c_hi sqrt L) + P(S < -c_lo sqrt L) -> Phi(-c_hi / sigma) + Phi(-c_lo / sigma), flat in L

``eps_lower=None`` (``c_lower=None``) makes the band symmetric in log space.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import numpy as np
from scipy.special import ndtr

ArrayLike = Union[float, np.ndarray, list]
Out = Union[np.ndarray, Tuple[np.ndarray, np.ndarray]]


def _as_len(L: ArrayLike) -> np.ndarray:
    L = np.asarray(L, dtype=np.float64)
    if np.any(~np.isfinite(L)) or np.any(L < 0):
        raise ValueError("theory: lengths L must be finite and >= 0")
    return L


def _log_band(eps_upper: float, eps_lower: Optional[float]) -> Tuple[float, float]:
    if not eps_upper >= 0:
        raise ValueError(f"theory: eps_upper must be >= 0, got {eps_upper}")
    hi = float(np.log1p(eps_upper))
    if eps_lower is None:
        return hi, -hi
    if not 0 <= eps_lower < 1:
        raise ValueError(f"theory: eps_lower must be in [0, 1) (ratio floor 1 - eps_lower > 0), got {eps_lower}")
    return hi, float(np.log1p(-eps_lower))


def _two_sided(hi: np.ndarray, lo: np.ndarray, mean: np.ndarray, scale: np.ndarray, parts: bool) -> Out:
    """P(X > hi), P(X < lo) for X ~ N(mean, scale^2); scale = 0 means X = mean."""
    with np.errstate(divide="ignore", invalid="ignore"):
        up = np.where(scale > 0, ndtr(-(hi - mean) / scale), (mean > hi).astype(np.float64))
        dn = np.where(scale > 0, ndtr((lo - mean) / scale), (mean < lo).astype(np.float64))
    return (up, dn) if parts else up + dn


def c_rloo(L: ArrayLike, sigma: float, eps_upper: float, eps_lower: Optional[float] = None,
           mu: float = 0.0, parts: bool = False) -> Out:
    """RLOO's P(S_L > log(1 + eps_hi)) + P(S_L < log(1 - eps_lo))."""
    L = _as_len(L)
    hi, lo = _log_band(eps_upper, eps_lower)
    return _two_sided(np.full_like(L, hi), np.full_like(L, lo), mu * L, sigma * np.sqrt(L), parts)


def c_gspo(L: ArrayLike, sigma: float, eps_upper: float, eps_lower: Optional[float] = None,
           mu: float = 0.0, parts: bool = False) -> Out:
    """GSPO's P(S_L / L > log(1 + eps_hi)) + P(S_L / L < log(1 - eps_lo)); 0 at L = 0."""
    L = _as_len(L)
    hi, lo = _log_band(eps_upper, eps_lower)
    with np.errstate(divide="ignore"):
        scale = np.where(L > 0, sigma / np.sqrt(np.maximum(L, 1e-300)), 0.0)
    out = _two_sided(np.full_like(L, hi), np.full_like(L, lo), np.full_like(L, mu), scale, parts)
    if parts:
        return tuple(np.where(L > 0, o, 0.0) for o in out)
    return np.where(L > 0, out, 0.0)


def c_fspo(L: ArrayLike, sigma: Optional[float] = None, c_upper: Optional[float] = None,
           c_lower: Optional[float] = None, *, z: Optional[float] = None, mu: float = 0.0,
           parts: bool = False) -> Out:
    """FSPO's band [-c_lo sqrt(L), c_hi sqrt(L)]: ``sigma`` and ``c_upper`` (``c_lower`` defaults to it), or ``z``
    (c = z sigma; ``sigma`` needed only when mu != 0)."""
    L = _as_len(L)
    if z is not None:
        if mu != 0 and sigma is None:
            raise ValueError("c_fspo: with mu != 0 pass sigma as well as z")
        sigma = 1.0 if sigma is None else sigma
        c_upper = c_lower = z * sigma
    if sigma is None or c_upper is None:
        raise ValueError("c_fspo: pass either z=..., or sigma and c_upper (c_lower defaults to c_upper)")
    c_lower = c_upper if c_lower is None else c_lower
    if not (sigma > 0 and c_upper > 0 and c_lower > 0):
        raise ValueError(f"c_fspo: sigma, c_upper, c_lower must be > 0, got {sigma}, {c_upper}, {c_lower}")
    r = np.sqrt(L)
    return _two_sided(c_upper * r, -c_lower * r, mu * L, sigma * r, parts)


def c_rloo_symmetric(L: ArrayLike, sigma: float, xi: float) -> np.ndarray:
    """Paper eq. (1), mu_L ~ 0: ``2 Phi(-xi / (sigma sqrt(L)))``, xi = log(1 + c_upper)."""
    L = _as_len(L)
    with np.errstate(divide="ignore"):
        return np.where(L > 0, 2.0 * ndtr(-xi / (sigma * np.sqrt(L))), 0.0)


def c_gspo_symmetric(L: ArrayLike, sigma: float, xi: float) -> np.ndarray:
    """Paper eq. (2), mu_L ~ 0: ``2 Phi(-xi sqrt(L) / sigma)``."""
    L = _as_len(L)
    return np.where(L > 0, 2.0 * ndtr(-xi * np.sqrt(L) / sigma), 0.0)


def c_fspo_symmetric(L: ArrayLike, z: float) -> np.ndarray:
    """Paper: ``c_FSPO(L) = 2 Phi(-z)``, independent of L (0 at L = 0)."""
    L = _as_len(L)
    return np.where(L > 0, 2.0 * ndtr(-z), 0.0)
