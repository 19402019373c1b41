"""Bands on the sequence log-ratio S judged on the same sequences: the length law's out-of-band tests.
Out of band: S < lo or S > hi, with

  FSPO     -c sqrt(L), +c sqrt(L)                 RLOO   log(1 - low), log(1 + high)
  GSPO     L log(1 - low), L log(1 + high)        affine mu_L -+ z sqrt(tau^2 + sigma^2 L), mu_L = m L
  quantile mu_L -+ q_b(L), q_b the erf(z / sqrt 2) quantile of |S - mu_L| in L's bin

`matched_bands` makes every band the same interval of S at the median length L_med (RLOO's xi = c sqrt(L_med),
GSPO's xi / L_med); `judge` tests one band; `out_of_sample` fits a band on earlier steps and judges step t.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, Optional

import numpy as np

from fspo.diagnostics import law_stats as st


class SqrtBand:
    """FSPO: |S| <= c sqrt(L)."""

    def __init__(self, c: float):
        self.c = float(c)

    def limits(self, L):
        h = self.c * np.sqrt(np.asarray(L, float))
        return -h, h


class RatioBand:
    """RLOO: 1 - low <= exp(S) <= 1 + high."""

    def __init__(self, low: float, high: float):
        self.lo, self.hi = math.log(1 - low), math.log(1 + high)

    def limits(self, L):
        z = np.zeros(np.shape(L))
        return z + self.lo, z + self.hi


class TokenRatioBand(RatioBand):
    """GSPO: 1 - low <= exp(S / L) <= 1 + high."""

    def limits(self, L):
        L = np.asarray(L, float)
        return L * self.lo, L * self.hi


class AffineBand:
    """mu_L -+ z sqrt(tau^2 + sigma^2 L): m by least squares through 0, then `law_stats.affine_variance` of the
    residuals (tau^2 >= 0, sigma^2 > 0)."""

    def __init__(self, z: float = 1.0, per_octave: int = 2, min_count: int = 10):
        self.z, self.per_octave, self.min_count = float(z), per_octave, min_count
        self.m, self.tau2, self.sigma2 = 0.0, 0.0, 1e-12

    def fit(self, L, S) -> "AffineBand":
        L, S = np.asarray(L, float), np.asarray(S, float)
        self.m = float((L * S).sum() / max((L * L).sum(), 1e-12))
        edges = st.geometric_edges(max(1.0, L.min()), L.max() + 1, self.per_octave)
        fit = st.affine_variance(st.bin_moments(L, S - self.m * L, edges), self.min_count)
        if fit["sigma2"] is None:  # too few bins: the sqrt law through the mean square
            self.tau2, self.sigma2 = 0.0, float(np.mean((S - self.m * L) ** 2 / np.maximum(L, 1)))
        else:
            self.tau2, self.sigma2 = max(fit["tau2"], 0.0), max(fit["sigma2"], 1e-12)
        return self

    def limits(self, L):
        L = np.asarray(L, float)
        h = self.z * np.sqrt(self.tau2 + self.sigma2 * L)
        return self.m * L - h, self.m * L + h


class BinQuantileBand(AffineBand):
    """mu_L -+ q_b (the affine band in bins with fewer than ``min_count`` sequences): exact coverage for any shape of
    S_L, at the cost of noise."""

    def fit(self, L, S) -> "BinQuantileBand":
        super().fit(L, S)
        L, S = np.asarray(L, float), np.asarray(S, float)
        self.edges = st.geometric_edges(max(1.0, L.min()), L.max() + 1, self.per_octave)
        idx, cover = st.bin_index(L, self.edges), math.erf(self.z / math.sqrt(2))
        self.q = np.full(len(self.edges) - 1, np.nan)
        for b in range(len(self.q)):
            r = np.abs(S[idx == b] - self.m * L[idx == b])
            if len(r) >= self.min_count:
                self.q[b] = np.quantile(r, cover)
        return self

    def limits(self, L):
        lo, hi = super().limits(L)
        idx = st.bin_index(np.asarray(L, float), self.edges)
        q = np.where(idx >= 0, self.q[np.maximum(idx, 0)], np.nan)
        mid = self.m * np.asarray(L, float)
        return np.where(np.isnan(q), lo, mid - q), np.where(np.isnan(q), hi, mid + q)


def matched_bands(c: float, l_med: float) -> Dict[str, object]:
    """FSPO's c sqrt(L) band and the RLOO / GSPO bands equal to it at ``l_med``."""
    xi = c * math.sqrt(l_med)
    return {"fspo": SqrtBand(c), "rloo": RatioBand(1 - math.exp(-xi), math.exp(xi) - 1),
            "gspo": TokenRatioBand(1 - math.exp(-xi / l_med), math.exp(xi / l_med) - 1)}


def judge(L, S, outside, edges, min_count: int = 50, limits=None, seed: int = 0, clusters=None) -> Dict[str, object]:
    """Out-of-band test of one band over ``edges`` (bins with >= ``min_count``): n, k, c = k / n with Wilson CIs,
    ``p_homogeneity``, ``lre`` and ``lre_floor``, ``span``, ``ratio_last_first`` / ``ratio_first_last``, ``out_rate``;
    with ``limits`` the Gaussian prediction ``c_gauss``; with ``clusters`` ``design_effect`` and
    ``p_homogeneity_clustered``."""
    L, S, out = np.asarray(L, float), np.asarray(S, float), np.asarray(outside, bool)
    idx = st.bin_index(L, edges)
    nb = len(edges) - 1
    n = np.bincount(idx[idx >= 0], minlength=nb)
    keep = np.flatnonzero(n >= min_count)
    k = np.array([out[idx == b].sum() for b in keep], float)
    nn = n[keep].astype(float)
    mean_l = np.array([L[idx == b].mean() for b in keep])
    lo_ci, hi_ci = st.wilson(k, nn)
    c = k / np.maximum(nn, 1)
    res = {"bins": [(edges[b], edges[b + 1]) for b in keep], "n": nn.tolist(), "k": k.tolist(), "c": c.tolist(),
           "ci_lo": lo_ci.tolist(), "ci_hi": hi_ci.tolist(), "mean_l": mean_l.tolist(),
           "p_homogeneity": st.homogeneity_p(k, nn), "lre": st.lre_from_counts(k, nn)}
    if clusters is not None:
        sel = np.isin(idx, keep)
        res["design_effect"] = st.design_effect(out[sel], np.asarray(clusters)[sel], idx[sel])
        res["p_homogeneity_clustered"] = st.homogeneity_p(k, nn, res["design_effect"])
    res["span"] = float(mean_l[-1] / mean_l[0]) if len(keep) >= 2 else None
    res["ratio_last_first"] = _ratio(c[-1], c[0]) if len(keep) >= 2 else None
    res["ratio_first_last"] = _ratio(c[0], c[-1]) if len(keep) >= 2 else None
    if len(keep):
        rate = float(k.sum() / nn.sum())
        res["lre_floor"] = st.lre_noise_floor(nn, rate, seed=seed)
        res["out_rate"] = rate
    if limits is not None:
        lo, hi = (np.asarray(x, float) for x in limits)
        gauss = []
        for b in keep:
            m = idx == b
            gauss.append(float(st.gaussian_out_frac(L[m], lo[m], hi[m], S[m].mean(), S[m].std(ddof=1)).mean()))
        res["c_gauss"] = gauss
    return res


def _ratio(a: float, b: float) -> Optional[float]:
    """a / b; inf where only b is 0 (a bin with no sequence out of band); None where both are."""
    if b > 0:
        return float(a / b)
    return math.inf if a > 0 else None


def out_of_sample(L, S, step, update, make_band: Callable[[], AffineBand], min_history: int = 64
                  ) -> Dict[str, np.ndarray]:
    """Fit ``make_band()`` on the earlier steps' sequences of the same mini-batch index and judge step t with it,
    where >= ``min_history`` sequences fit. Returns ``judged``, ``outside``, ``lo``, ``hi`` per row (NaN where not
    judged)."""
    L, S = np.asarray(L, float), np.asarray(S, float)
    step, update = np.asarray(step), np.asarray(update)
    judged, outside = np.zeros(len(L), bool), np.zeros(len(L), bool)
    lo, hi = np.full(len(L), np.nan), np.full(len(L), np.nan)
    for t in np.unique(step):
        for u in np.unique(update[step == t]):
            now = (step == t) & (update == u)
            past = (step < t) & (update == u)
            if past.sum() < min_history:
                continue
            band = make_band().fit(L[past], S[past])
            a, b = band.limits(L[now])
            lo[now], hi[now] = a, b
            judged[now] = True
            outside[now] = (S[now] < a) | (S[now] > b)
    return {"judged": judged, "outside": outside, "lo": lo, "hi": hi}


def cluster_ids(rec) -> np.ndarray:
    """One id per (step, prompt group) of a record set."""
    return np.asarray(rec["step"]) * 1e6 + np.asarray(rec["group"])


def outside_of(band, L, S) -> np.ndarray:
    """Flags S < lo(L) or S > hi(L) for a band with ``limits``."""
    lo, hi = band.limits(L)
    return (np.asarray(S) < lo) | (np.asarray(S) > hi)
