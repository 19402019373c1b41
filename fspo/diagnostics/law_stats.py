"""Statistics of the length law on per-sequence records (numpy / scipy): the std(S_L) ~ L^gamma fit with a
bootstrap CI over prompts, the affine variance fit Var(S_L) = tau^2 + sigma^2 L (L* = tau^2 / sigma^2), the
variance inflation Var(S_L) / E[sum_t d_t^2] (1 for martingale terms, above 1 for correlated ones), and the
out-of-band tests (Wilson CIs, chi-square homogeneity, LRE and its noise floor, the Gaussian prediction).
Why (docs/length_law.md): a length-independent variance tau^2 flattens std(S_L) below L*, and per-token terms
not comparable along the response bend the exponent below 1/2. Bins are half-open; statistics over bins use
bins with >= ``min_count`` sequences; None (not NaN) where there is no data.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np
from scipy import stats


def geometric_edges(lo: float, hi: float, per_octave: int = 2) -> List[int]:
    """Integer edges lo, lo 2^(1/k), ..., the first >= hi (k = ``per_octave``); duplicates dropped."""
    if not 0 < lo < hi or per_octave < 1:
        raise ValueError(f"geometric_edges needs 0 < lo < hi and per_octave >= 1, got {lo}, {hi}, {per_octave}")
    out, j = [], 0
    while True:
        e = int(round(lo * 2 ** (j / per_octave)))
        if not out or e > out[-1]:
            out.append(e)
        if e >= hi:
            return out
        j += 1


def bin_index(lengths: np.ndarray, edges: Sequence[float]) -> np.ndarray:
    """Bin of each length in [edges[k], edges[k+1]); -1 outside [edges[0], edges[-1])."""
    e = np.asarray(edges, dtype=float)
    idx = np.searchsorted(e, np.asarray(lengths, dtype=float), side="right") - 1
    idx[(idx < 0) | (idx >= len(e) - 1)] = -1
    return idx


@dataclass
class BinMoments:
    """Per-bin n, mean L, mean S, sample variance of S (ddof 1), mean of sum_t d_t^2 (if given)."""

    edges: List[float]
    n: np.ndarray
    mean_l: np.ndarray
    mean_s: np.ndarray
    var_s: np.ndarray
    mean_d2: Optional[np.ndarray] = None

    def populated(self, min_count: int) -> np.ndarray:
        return self.n >= max(2, min_count)


def bin_moments(lengths, s, edges, sum_d2=None) -> BinMoments:
    """Moments of S per length bin (see `BinMoments`)."""
    L, S = np.asarray(lengths, float), np.asarray(s, float)
    idx, k = bin_index(L, edges), len(edges) - 1
    n = np.bincount(idx[idx >= 0], minlength=k).astype(float)
    out = dict(mean_l=np.zeros(k), mean_s=np.zeros(k), var_s=np.zeros(k))
    d2 = np.zeros(k) if sum_d2 is not None else None
    for b in range(k):
        m = idx == b
        if m.any():
            out["mean_l"][b], out["mean_s"][b] = L[m].mean(), S[m].mean()
            out["var_s"][b] = S[m].var(ddof=1) if m.sum() > 1 else 0.0
            if d2 is not None:
                d2[b] = np.asarray(sum_d2, float)[m].mean()
    return BinMoments(list(edges), n, mean_d2=d2, **out)


def std_exponent(m: BinMoments, min_count: int = 20) -> Dict[str, Optional[float]]:
    """gamma, prefactor and R^2 of the least-squares fit log std_b = log c + gamma log mean-L_b (theory 1/2)."""
    ok = m.populated(min_count) & (m.var_s > 0)
    if ok.sum() < 2:
        return {"exponent": None, "prefactor": None, "r2": None, "bins": int(ok.sum())}
    x, y = np.log(m.mean_l[ok]), 0.5 * np.log(m.var_s[ok])
    fit = stats.linregress(x, y)
    return {"exponent": float(fit.slope), "prefactor": float(math.exp(fit.intercept)), "r2": float(fit.rvalue ** 2),
            "bins": int(ok.sum())}


def bootstrap_exponent(lengths, s, clusters, edges, min_count: int = 20, n_boot: int = 400,
                       seed: int = 0, level: float = 0.95) -> Optional[tuple]:
    """Percentile CI of the std exponent, resampling whole clusters (prompts) with replacement; None with fewer than
    2 clusters."""
    L, S, c = np.asarray(lengths, float), np.asarray(s, float), np.asarray(clusters)
    uniq, inv = np.unique(c, return_inverse=True)
    if len(uniq) < 2:
        return None
    members = [np.flatnonzero(inv == j) for j in range(len(uniq))]
    rng, draws = np.random.default_rng(seed), []
    for _ in range(n_boot):
        pick = np.concatenate([members[j] for j in rng.integers(0, len(uniq), len(uniq))])
        g = std_exponent(bin_moments(L[pick], S[pick], edges), min_count)["exponent"]
        if g is not None:
            draws.append(g)
    if len(draws) < n_boot // 2:
        return None
    a = (1 - level) / 2
    return float(np.quantile(draws, a)), float(np.quantile(draws, 1 - a))


def affine_variance(m: BinMoments, min_count: int = 20) -> Dict[str, Optional[float]]:
    """Weighted least squares of var_b = tau^2 + sigma^2 mean-L_b, weights (n_b - 1) / var_b^2; L* = tau^2 / sigma^2
    (None unless both > 0)."""
    ok = m.populated(min_count) & (m.var_s > 0)
    if ok.sum() < 2:
        return {"tau2": None, "sigma2": None, "l_star": None}
    x, y = m.mean_l[ok], m.var_s[ok]
    w = (m.n[ok] - 1) / y ** 2
    a = np.stack([np.ones_like(x), x], 1)
    tau2, sigma2 = np.linalg.lstsq(a * np.sqrt(w)[:, None], y * np.sqrt(w), rcond=None)[0]
    star = float(tau2 / sigma2) if tau2 > 0 and sigma2 > 0 else None
    return {"tau2": float(tau2), "sigma2": float(sigma2), "l_star": star}


def variance_inflation(m: BinMoments, min_count: int = 20) -> Dict[str, Optional[float]]:
    """Var(S_L) / E[sum_t d_t^2], pooled over the populated bins (n-weighted) and per bin (1: martingale terms)."""
    if m.mean_d2 is None:
        return {"pooled": None}
    ok = m.populated(min_count) & (m.mean_d2 > 0)
    if not ok.any():
        return {"pooled": None}
    per = m.var_s[ok] / m.mean_d2[ok]
    return {"pooled": float((m.n[ok] * m.var_s[ok]).sum() / (m.n[ok] * m.mean_d2[ok]).sum()),
            "per_bin": [float(v) for v in per]}


def wilson(k: np.ndarray, n: np.ndarray, level: float = 0.95):
    """Wilson score interval of k successes in n trials, elementwise; (0, 1) where n = 0."""
    k, n = np.asarray(k, float), np.asarray(n, float)
    z = stats.norm.ppf(0.5 + level / 2)
    p = np.divide(k, n, out=np.zeros_like(k), where=n > 0)
    den = 1 + z * z / np.maximum(n, 1)
    mid = (p + z * z / (2 * np.maximum(n, 1))) / den
    half = z * np.sqrt(p * (1 - p) / np.maximum(n, 1) + z * z / (4 * np.maximum(n, 1) ** 2)) / den
    lo, hi = np.where(n > 0, mid - half, 0.0), np.where(n > 0, mid + half, 1.0)
    return np.clip(lo, 0, 1), np.clip(hi, 0, 1)


def homogeneity_p(k: np.ndarray, n: np.ndarray, deff: float = 1.0) -> Optional[float]:
    """p-value of Pearson's chi-square test that every bin has the same out-of-band rate (2 x bins table), X^2
    divided by the design effect ``deff`` (Rao-Scott's first-order correction for clustered sequences; below 1
    taken as 1). 1.0 when no bin (or every bin) is out of band; None with fewer than 2 bins."""
    k, n = np.asarray(k, float), np.asarray(n, float)
    if len(n) < 2:
        return None
    if k.sum() == 0 or (n - k).sum() == 0:
        return 1.0
    chi2, _, dof, _ = stats.chi2_contingency(np.stack([k, n - k]), correction=False)
    return float(stats.chi2.sf(chi2 / max(1.0, deff), dof))


homogeneity_p_clustered = homogeneity_p


def design_effect(outside, clusters, bins) -> float:
    """Rao-Scott design effect of the out-of-band rate: each bin's variance with whole clusters (prompt groups)
    over its binomial variance, averaged with the bins' sequence counts; 1 for independent sequences."""
    out, cl, b = np.asarray(outside, float), np.asarray(clusters), np.asarray(bins)
    num = den = 0.0
    for k in np.unique(b[b >= 0]):
        m = b == k
        p, n = out[m].mean(), m.sum()
        if p <= 0 or p >= 1:
            continue
        _, inv = np.unique(cl[m], return_inverse=True)
        y, size = np.bincount(inv, weights=out[m]), np.bincount(inv).astype(float)
        J = len(size)
        if J < 2:
            continue
        v_cluster = J / (J - 1) * ((y - p * size) ** 2).sum() / n ** 2
        num += n * v_cluster / (p * (1 - p) / n)
        den += n
    return float(num / den) if den else 1.0


def lre_from_counts(k: np.ndarray, n: np.ndarray) -> Optional[float]:
    """The paper's LRE with q_b = 1 - k_b / n_b (0 if q_bar = 0; None without sequences)."""
    k, n = np.asarray(k, float), np.asarray(n, float)
    if n.sum() <= 0:
        return None
    q = 1 - k / np.maximum(n, 1)
    qbar = (n * q).sum() / n.sum()
    return 0.0 if qbar <= 0 else float(0.5 * (n * np.abs(q / qbar - 1)).sum() / n.sum())


def lre_noise_floor(n: np.ndarray, out_rate: float, n_sim: int = 2000, seed: int = 0) -> Dict[str, float]:
    """Mean and 95th percentile of the LRE of an exactly flat band at these counts (k_b ~ Binomial(n_b, out_rate))."""
    n = np.asarray(n, int)
    rng = np.random.default_rng(seed)
    k = rng.binomial(n[None, :], out_rate, size=(n_sim, len(n)))
    sims = np.array([lre_from_counts(row, n) for row in k])
    return {"mean": float(sims.mean()), "p95": float(np.quantile(sims, 0.95))}


def gaussian_out_frac(lengths, lo, hi, mean_s, std_s) -> np.ndarray:
    """P(S outside [lo, hi]) for S ~ N(mean_s, std_s^2), per sequence (arrays broadcast)."""
    mu, sd = np.asarray(mean_s, float), np.maximum(np.asarray(std_s, float), 1e-12)
    return stats.norm.cdf((np.asarray(lo) - mu) / sd) + stats.norm.sf((np.asarray(hi) - mu) / sd)
