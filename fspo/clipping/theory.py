"""Closed-form clip probabilities under the Gaussian law S_L ~ N(mu_L, sigma^2 L) (paper eq. c_rloo/c_gspo).

Owns: exact out-of-band probabilities for asymmetric bands and the paper's symmetric
approximations, vectorised over L (numpy in, numpy float64 out): the paper's c(L) = 1 - q(L),
observed as ``band/out_frac/<bin>``. Leaves out: the pessimistic-min binding (a clip only binds
when the advantage sign matches the side: with P(A > 0) = p, the observed binding fraction
``clip/seq_frac`` is about p * upper + (1 - p) * lower; use ``parts=True``), and dual clipping.

Drift: ``mu`` is the per-token drift, mu_L = mu * L (E[S_L] = -sum_t KL_t, paper eq. mu_kl).
L = 0 gives S = 0 (an empty sequence is never clipped): probability 0 for RLOO/FSPO.

Exact forms (Phi the standard normal CDF, s_L = sigma sqrt(L)):

    RLOO  exp(S) in [1 - eps_lo, 1 + eps_hi]:  P(S > log(1 + eps_hi)) + P(S < log(1 - eps_lo))
          = Phi(-(log(1+eps_hi) - mu_L)/s_L) + Phi((log(1-eps_lo) - mu_L)/s_L)
    GSPO  exp(S/L) in the same band: S/L ~ N(mu, sigma^2/L), same formula with s = sigma/sqrt(L)
    FSPO  S in [-c_lo sqrt(L), c_hi sqrt(L)] (log space, mu_hat = 0 in the band):
          = Phi(-(c_hi sqrt(L) - mu_L)/s_L) + Phi((-c_lo sqrt(L) - mu_L)/s_L)
          -> Phi(-c_hi/sigma) + Phi(-c_lo/sigma), flat in L when mu = 0; 2 Phi(-z) when c = z sigma.

With ``eps_lower=None`` (resp. ``c_lower=None``) the band is symmetric in log space
(lower = -log(1 + eps_hi)), and with mu = 0 the exact forms equal the approximations below.
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
    """P(X > hi), P(X < lo) for X ~ N(mean, scale^2); scale = 0 means X = mean exactly."""
    with np.errstate(divide="ignore", invalid="ignore"):
        up = np.where(scale > 0, ndtr(-(hi - mean) / scale), (mean > hi).astype(np.float64))
        dn = np.where(scale > 0, ndtr((lo - mean) / scale), (mean < lo).astype(np.float64))
    return (up, dn) if parts else up + dn


def c_rloo(L: ArrayLike, sigma: float, eps_upper: float, eps_lower: Optional[float] = None,
           mu: float = 0.0, parts: bool = False) -> Out:
    """RLOO clip probability P(S_L > log(1+eps_hi)) + P(S_L < log(1-eps_lo)), S_L ~ N(mu L, sigma^2 L).

    ``parts=True`` returns (upper, lower) separately.
    """
    L = _as_len(L)
    hi, lo = _log_band(eps_upper, eps_lower)
    return _two_sided(np.full_like(L, hi), np.full_like(L, lo), mu * L, sigma * np.sqrt(L), parts)


def c_gspo(L: ArrayLike, sigma: float, eps_upper: float, eps_lower: Optional[float] = None,
           mu: float = 0.0, parts: bool = False) -> Out:
    """GSPO clip probability P(S_L/L > log(1+eps_hi)) + P(S_L/L < log(1-eps_lo)), S_L/L ~ N(mu, sigma^2/L).

    L = 0 has no defined ratio; it is reported as 0 (never clipped).
    """
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
    """FSPO clip probability for the log-space band [-c_lo sqrt(L), c_hi sqrt(L)] (mu_hat = 0).

    Give ``sigma`` and ``c_upper`` (and optionally ``c_lower``), or ``z`` (then c = z sigma;
    ``sigma`` is only needed when mu != 0): P(S_L > c_hi sqrt L) + P(S_L < -c_lo sqrt L).
    """
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
    """Paper eq. (c_rloo), mu_L ~ 0: ``2 Phi(-xi / (sigma sqrt(L)))``, xi = log(1 + c_upper)."""
    L = _as_len(L)
    with np.errstate(divide="ignore"):
        return np.where(L > 0, 2.0 * ndtr(-xi / (sigma * np.sqrt(L))), 0.0)


def c_gspo_symmetric(L: ArrayLike, sigma: float, xi: float) -> np.ndarray:
    """Paper eq. (c_gspo), mu_L ~ 0: ``2 Phi(-xi sqrt(L) / sigma)``."""
    L = _as_len(L)
    return np.where(L > 0, 2.0 * ndtr(-xi * np.sqrt(L) / sigma), 0.0)


def c_fspo_symmetric(L: ArrayLike, z: float) -> np.ndarray:
    """Paper: ``c_FSPO(L) = 2 Phi(-z)``, independent of L (0 at L = 0)."""
    L = _as_len(L)
    return np.where(L > 0, 2.0 * ndtr(-z), 0.0)
