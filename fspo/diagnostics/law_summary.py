"""The length law of one run from its sequence records: flat ``law/*`` scalars answering "is clipping fair
across lengths in my run?" (logged as ``run/law/*``). Bins are geometric, ``per_octave`` per doubling; a
statistic over bins uses bins with >= ``min_count`` sequences:

  law/std_exponent (+ _ci_lo, _ci_hi over (step, prompt) clusters; _r2)   theory 1/2
  law/tau2, law/sigma2, law/l_star, law/var_inflation
  law/own/{p_homogeneity, p_homogeneity_clustered, design_effect, lre, lre_floor, out_rate}  the run's band
  law/bands/<b>/{p_homogeneity, lre, lre_floor, ratio_last_first, out_rate}  b in fspo, rloo, gspo (matched
      at the median length, c = sigma_hat) and affine / quantile (fit out of sample): one set of sequences
  law/span, law/n_seq, law/gate/std_exponent (+ _ci_lo, _ci_hi, _r2: a random parameter direction)
"""
from __future__ import annotations

import math
from typing import Dict, List

import numpy as np

from fspo.diagnostics import law_bands as lb
from fspo.diagnostics import law_stats as st


def _edges(L: np.ndarray, per_octave: int) -> List[int]:
    return st.geometric_edges(max(1.0, float(L.min())), float(L.max()) + 1, per_octave)


def band_results(rec: Dict[str, np.ndarray], edges, min_count: int, seed: int = 0) -> Dict[str, dict]:
    """`law_bands.judge` of every panel band on the records."""
    L, S = rec["length"], rec["s"]
    sigma = math.sqrt(float(np.mean(S ** 2 / np.maximum(L, 1))))
    out = {}
    for name, band in lb.matched_bands(sigma, float(np.median(L))).items():
        out[name] = lb.judge(L, S, lb.outside_of(band, L, S), edges, min_count, band.limits(L), seed,
                             lb.cluster_ids(rec))
    for name, make in (("affine", lambda: lb.AffineBand(z=1.0)), ("quantile", lambda: lb.BinQuantileBand(z=1.0))):
        oos = lb.out_of_sample(L, S, rec["step"], rec["update"], make)
        j = oos["judged"]
        if j.sum() >= min_count:
            out[name] = lb.judge(L[j], S[j], oos["outside"][j], edges, min_count,
                                 (oos["lo"][j], oos["hi"][j]), seed, lb.cluster_ids(rec)[j])
    return out


def law_summary(rec: Dict[str, np.ndarray], per_octave: int = 2, min_count: int = 50, n_boot: int = 200,
                seed: int = 0, panel: bool = True) -> Dict[str, float]:
    """Flat ``{law/...: float}`` of one run's records; {} with none. Records with ``update == -1`` are the
    random-direction gate's (``law/gate/*``)."""
    gate = (rec["update"] == -1) & (rec["length"] > 0)
    out: Dict[str, float] = {}

    def exponent(prefix: str, r: Dict[str, np.ndarray], edges, m: st.BinMoments) -> None:
        fit = st.std_exponent(m, min_count)
        if fit["exponent"] is not None:
            out[f"{prefix}std_exponent"], out[f"{prefix}std_exponent_r2"] = fit["exponent"], fit["r2"]
            ci = st.bootstrap_exponent(r["length"], r["s"], lb.cluster_ids(r), edges, min_count, n_boot, seed)
            if ci is not None:
                out[f"{prefix}std_exponent_ci_lo"], out[f"{prefix}std_exponent_ci_hi"] = ci
    if gate.sum() >= 2:
        g = {k: v[gate] for k, v in rec.items()}
        edges = _edges(g["length"], per_octave)
        exponent("law/gate/", g, edges, st.bin_moments(g["length"], g["s"], edges))
    keep = (rec["update"] >= 0) & (rec["length"] > 0)
    rec = {k: v[keep] for k, v in rec.items()}
    L, S = rec["length"], rec["s"]
    if len(L) < 2:
        return out
    edges = _edges(L, per_octave)
    m = st.bin_moments(L, S, edges, rec["d2"])
    out["law/n_seq"] = float(len(L))
    exponent("law/", rec, edges, m)
    for k, v in st.affine_variance(m, min_count).items():
        if v is not None:
            out[f"law/{k}"] = v
    infl = st.variance_inflation(m, min_count)["pooled"]
    if infl is not None:
        out["law/var_inflation"] = infl
    own = lb.judge(L, S, rec["out"] > 0.5, edges, min_count, seed=seed, clusters=lb.cluster_ids(rec))
    _put(out, "law/own", own)
    if own.get("span") is not None:
        out["law/span"] = own["span"]
    if panel:
        for name, res in band_results(rec, edges, min_count, seed).items():
            _put(out, f"law/bands/{name}", res)
    return out


def _put(out: Dict[str, float], prefix: str, res: dict) -> None:
    for k in ("p_homogeneity", "p_homogeneity_clustered", "design_effect", "lre", "out_rate", "ratio_last_first"):
        if res.get(k) is not None and math.isfinite(res[k]):  # inf (a bin with nothing out) is not logged
            out[f"{prefix}/{k}"] = float(res[k])
    if "lre_floor" in res:
        out[f"{prefix}/lre_floor"] = res["lre_floor"]["mean"]


def law_table(summary: Dict[str, float]) -> List[str]:
    """The summary as aligned text lines."""
    return [f"{k:<40s} {v:.4g}" for k, v in sorted(summary.items())]
