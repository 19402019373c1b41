"""Power of the length-law sweep's targets: how often each passes when the sqrt(L) law holds exactly.

Simulates the planned sweep: per arm ``--seqs`` measured sequences with lengths drawn like the task's
(``--lengths mod_chain``: 6 n tokens, n log-uniform in 4..100; or ``uniform:LO:HI``), S_L ~ N(0, tau^2 +
sigma^2 L) (``--tau2`` 0: the law exactly), every band matched at the median length to FSPO's c = sigma
(z = 1), each arm an independent sample, judged by the same code the report uses (fspo/diagnostics/law_bands.py,
law_stats.py) over geometric bins (2 per octave, bins with >= ``--min-count`` sequences). Prints, per target,
the fraction of ``--sims`` simulated sweeps in which it passes, and writes them as JSON (``--out``).

    python benchmarks/law_power.py --seqs 2000 --sims 300
    python benchmarks/law_power.py --seqs 560 --sims 300 --lengths uniform:30:600    # the old sweep's size

The targets (the length-law sweep's "done when"): FSPO's std exponent in [0.4, 0.6]; every arm's populated
bins span >= 16x; FSPO's c(L) homogeneous (chi-square p >= 0.05); RLOO's c(L) last / first >= 3; GSPO's
first / last >= 3; FSPO's LRE <= half of min(RLOO, GSPO); the knock-out is not simulated (it breaks the law
on purpose). Size the sweep so that "all" is >= 0.8.
"""
from __future__ import annotations

import argparse
import math

import numpy as np
from _common import write_json

from fspo.diagnostics import law_bands as lb
from fspo.diagnostics import law_stats as st


def draw_lengths(rng, n: int, spec: str) -> np.ndarray:
    if spec == "mod_chain":
        return 6 * np.floor(np.exp(rng.uniform(math.log(4), math.log(101), n))).clip(4, 100)
    _, lo, hi = spec.split(":")
    return rng.integers(int(lo), int(hi) + 1, n).astype(float)


def one_sweep(rng, seqs: int, spec: str, sigma: float, tau2: float, min_count: int, l_med: float, edges):
    """The targets' pass/fail for one simulated sweep (independent samples per arm)."""
    out = {}
    res = {}
    for arm in ("fspo", "rloo", "gspo"):
        L = draw_lengths(rng, seqs, spec)
        S = rng.normal(0.0, np.sqrt(tau2 + sigma ** 2 * L))
        band = lb.matched_bands(sigma, l_med)[arm]
        res[arm] = lb.judge(L, S, lb.outside_of(band, L, S), edges, min_count)
        if arm == "fspo":
            g = st.std_exponent(st.bin_moments(L, S, edges), min_count)["exponent"]
            out["fspo_exponent_in_0.4_0.6"] = g is not None and 0.4 <= g <= 0.6
    out["span_16x_all_arms"] = all((r["span"] or 0) >= 16 for r in res.values())
    out["fspo_homogeneous"] = (res["fspo"]["p_homogeneity"] or 0) >= 0.05
    out["rloo_rises_3x"] = (res["rloo"]["ratio_last_first"] or 0) >= 3
    out["gspo_falls_3x"] = (res["gspo"]["ratio_first_last"] or 0) >= 3
    lre = {a: res[a]["lre"] for a in res}
    out["fspo_lre_half"] = lre["fspo"] is not None and lre["fspo"] <= 0.5 * min(lre["rloo"], lre["gspo"])
    out["all"] = all(out.values())
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=2000, help="measured sequences per arm")
    ap.add_argument("--sims", type=int, default=300)
    ap.add_argument("--lengths", default="mod_chain", help="mod_chain | uniform:LO:HI")
    ap.add_argument("--sigma", type=float, default=0.03)
    ap.add_argument("--tau2", type=float, default=0.0, help="length-independent variance (0: the law exactly)")
    ap.add_argument("--min-count", type=int, default=50)
    ap.add_argument("--per-octave", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    rng = np.random.default_rng(a.seed)
    ref = draw_lengths(rng, 100_000, a.lengths)
    l_med = float(np.median(ref))
    edges = st.geometric_edges(ref.min(), ref.max() + 1, a.per_octave)
    rows = [one_sweep(rng, a.seqs, a.lengths, a.sigma, a.tau2, a.min_count, l_med, edges) for _ in range(a.sims)]
    p = {k: float(np.mean([r[k] for r in rows])) for k in rows[0]}
    for k, v in p.items():
        half = 1.96 * math.sqrt(max(v * (1 - v), 1e-9) / a.sims)
        print(f"{k:<28s} {v:.3f} (+- {half:.3f})")
    print(f"sims {a.sims}, {a.seqs} sequences per arm, lengths {a.lengths} (median {l_med:.0f}), tau2 {a.tau2}")
    if a.out:
        write_json(a.out, {"args": vars(a), "pass_probability": p, "l_med": l_med, "edges": edges})
    return p


if __name__ == "__main__":
    main()
