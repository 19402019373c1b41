"""Synthetic check of the whole diagnostic chain against the Gaussian theory (paper section gaussian).

S_L ~ N(0, sigma^2 L), sigma = 0.03, L uniform on [100, 20000), advantages alternating +1/-1.
Each sequence's tokens carry d_t = S/L, so the real clip rules (FSPOClip, RLOOClip, GSPOClip with the
paper's settings) see exactly S (and S/L for GSPO); their binding masks go through FairnessMetrics.

Expected LRE is computed in closed form from fspo.diagnostics.theory: a clip binds only on the side
that matches the advantage sign (A > 0: upper; A < 0: lower, plus dual), so with balanced signs
P(bind | L) = 0.5 upper(L) + 0.5 (lower(L) + dual(L)). Under this model (and 1000-token bins) the
theory gives LRE(RLOO) ~ 0.078 and LRE(GSPO) ~ 0.044, FSPO 0; the issue's "> 0.10" for RLOO/GSPO is
not reachable with the paper's settings and uniform lengths (the paper's 0.162/0.264 come from real
length distributions and real S), so we assert agreement with theory plus an ordering margin.
"""
import math

import numpy as np
import pytest
import torch

from fspo.clipping.fspo import FSPOClip
from fspo.clipping.gspo import GSPOClip
from fspo.clipping.rloo import RLOOClip
from fspo.diagnostics import FairnessMetrics, LengthBins, LogRatioStats, c_fspo, c_gspo, c_rloo, lre

SIGMA = 0.03
BINS = LengthBins(width=1000, max_len=20000)
N = 16_000


@pytest.fixture(autouse=True)
def _one_thread():
    """Intra-op threads on a shared 2-core box oversubscribe badly; restore afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _bind_prob(rule: str, L: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """P(the clip binds | L, sign A) under S ~ N(0, sigma^2 L) for the paper's settings."""
    if rule == "fspo":  # band +-0.03 sqrt(L); dual at +0.03 sqrt(L) for A < 0
        up, lo = c_fspo(L, SIGMA, 0.03, 0.03, parts=True)
        du = up
    elif rule == "rloo":  # ratio band [0.6, 1.667], dual at ratio 3
        up, lo = c_rloo(L, SIGMA, 0.667, 0.4, parts=True)
        du = c_rloo(L, SIGMA, 2.0, parts=True)[0]
    else:  # gspo: exp(S/L) in [1 - 3e-4, 1 + 4e-4], no dual
        up, lo = c_gspo(L, SIGMA, 4e-4, 3e-4, parts=True)
        du = np.zeros_like(up)
    return np.where(pos, up, lo + du)


@pytest.fixture(scope="module")
def runs():
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1234)
    L = torch.randint(100, 20000, (N,), generator=g)
    S = torch.randn(N, generator=g, dtype=torch.float64) * SIGMA * L.double().sqrt()
    A = torch.where(torch.arange(N) % 2 == 0, 1.0, -1.0)
    order = torch.argsort(L)
    out = {}
    for name, rule in (("fspo", FSPOClip()), ("rloo", RLOOClip()), ("gspo", GSPOClip())):
        fm = FairnessMetrics(BINS, reservoir_size=4096)
        for ch in order.split(200):  # length-sorted chunks keep T tight
            Lc = L[ch]
            T = int(Lc.max())
            mask = torch.arange(T)[None] < Lc[:, None]
            lp = (S[ch] / Lc.double()).float()[:, None] * mask
            res = rule(lp, torch.zeros_like(lp), A[ch], mask.long())
            fm.update_clip(res, Lc, mask.long(), A[ch])
            fm.update_rollout(Lc, Lc >= 19_000)
        out[name] = (fm, fm.compute())
    return L.numpy(), (A > 0).numpy(), out


def _theory_lre(rule, L, pos):
    p = _bind_prob(rule, L.astype(np.float64), pos)
    idx = BINS.index(torch.as_tensor(L)).numpy()
    n = np.bincount(idx, minlength=BINS.n_bins).astype(np.float64)
    c = np.bincount(idx, weights=p, minlength=BINS.n_bins)
    q = np.where(n > 0, 1 - c / np.maximum(n, 1), 1.0)
    return float(lre(torch.as_tensor(q), torch.as_tensor(n))), float(p.mean())


@pytest.mark.slow
def test_lre_per_rule_matches_theory_and_fspo_is_fair(runs):
    L, pos, out = runs
    got = {k: v[1]["fairness/lre"] for k, v in out.items()}
    print("observed LRE", got, "theory", {k: _theory_lre(k, L, pos)[0] for k in out})
    for name, (_, m) in out.items():
        theory_lre, theory_frac = _theory_lre(name, L, pos)
        assert m["fairness/lre"] == pytest.approx(theory_lre, abs=0.015), name
        sd = math.sqrt(theory_frac * (1 - theory_frac) / N)
        assert abs(m["clip/seq_frac"] - theory_frac) < 4 * sd, name
        assert m["fairness/lre_w"] == pytest.approx(m["fairness/lre"], abs=1e-12)  # |A| = 1 everywhere
    assert got["fspo"] < 0.02
    assert got["rloo"] > 0.06 and got["gspo"] > 0.03
    assert got["rloo"] > 4 * got["fspo"] and got["gspo"] > 3 * got["fspo"]


@pytest.mark.slow
def test_clip_fraction_shape_by_rule(runs):
    _, _, out = runs

    def curve(m):
        return np.array([m[f"clip/seq_frac/{lab}"] for lab in BINS.labels[:-1]])

    f, r, g = (curve(out[k][1]) for k in ("fspo", "rloo", "gspo"))
    assert np.ptp(f) < 0.08  # flat
    assert r[-1] - r[0] > 0.2 and g[0] - g[-1] > 0.15  # RLOO rises with L, GSPO falls
    # sequence rules: token fraction equals sequence fraction weighted by length, in [min, max]
    for _, m in out.values():
        assert 0 <= m["clip/tok_frac"] <= 1


@pytest.mark.slow
def test_gaussian_statistics_from_rule_ratios(runs):
    _, _, out = runs
    m = out["fspo"][1]
    print({k: m[k] for k in ("logratio/sigma_hat", "logratio/std_exponent", "logratio/qq_r2",
                             "logratio/qq_slope", "logratio/qq_intercept")})
    assert m["logratio/sigma_hat"] == pytest.approx(SIGMA, rel=0.03)
    assert m["logratio/std_exponent"] == pytest.approx(0.5, abs=0.05)
    assert m["logratio/qq_r2"] > 0.99
    assert m["logratio/qq_slope"] == pytest.approx(1.0, abs=0.05)
    assert abs(m["logratio/qq_intercept"]) < 0.05


def test_gaussian_statistics_paper_bins_large_sample():
    """200k draws straight into LogRatioStats with the paper's 200-token bins."""
    g = torch.Generator().manual_seed(7)
    n = 200_000
    L = torch.randint(100, 20000, (n,), generator=g)
    S = torch.randn(n, generator=g, dtype=torch.float64) * SIGMA * L.double().sqrt()
    m = LogRatioStats(LengthBins(width=200, max_len=20000), reservoir_size=4096)
    for sl in torch.arange(n).split(50_000):
        m.update(S[sl], L[sl])
    out = m.compute()
    print({k: v for k, v in out.items() if "/" in k and k.count("/") == 1})
    assert out["logratio/sigma_hat"] == pytest.approx(SIGMA, rel=0.01)
    assert out["logratio/sigma_hat_unbiased"] == pytest.approx(SIGMA, rel=0.01)
    assert out["logratio/std_exponent"] == pytest.approx(0.5, abs=0.03)
    assert out["logratio/qq_r2"] > 0.995


@pytest.mark.slow
def test_lre_two_sided_acceptance_as_in_the_paper():
    """The paper's acceptance event A_L = {|S| <= b_L} (section lre) is two-sided: a sequence is
    accepted when it lies inside the band whatever its advantage's sign. We measure it through the
    real rules by scoring every sequence with A = +1 and with A = -1 and counting it clipped when
    either binds (for A < 0 the dual bound is >= the upper bound, so the union is exactly "outside
    the band"). On S_L ~ N(0, sigma^2 L), L uniform on [100, 20000): LRE(FSPO) < 0.02 while
    LRE(RLOO) > 0.10 and LRE(GSPO) > 0.10 (the issue's thresholds)."""
    from fspo.clipping.base import ClipResult

    g = torch.Generator().manual_seed(99)
    n = 8000
    L = torch.randint(100, 20000, (n,), generator=g)
    S = torch.randn(n, generator=g, dtype=torch.float64) * SIGMA * L.double().sqrt()
    got = {}
    for name, rule in (("fspo", FSPOClip()), ("rloo", RLOOClip()), ("gspo", GSPOClip())):
        fm = FairnessMetrics(BINS, reservoir_size=256)
        for ch in torch.argsort(L).split(200):
            Lc = L[ch]
            mask = torch.arange(int(Lc.max()))[None] < Lc[:, None]
            lp = (S[ch] / Lc.double()).float()[:, None] * mask
            pos = rule(lp, torch.zeros_like(lp), torch.ones(len(ch)), mask.long())
            neg = rule(lp, torch.zeros_like(lp), -torch.ones(len(ch)), mask.long())
            outside = pos.clipped | neg.clipped
            none = torch.zeros_like(outside)
            both = ClipResult(pos.token_loss, pos.seq_log_ratio, outside, none, none)
            fm.update_clip(both, Lc, mask.long(), torch.ones(len(ch)))
        got[name] = fm.compute()["fairness/lre"]
    print("two-sided LRE", got)
    assert got["fspo"] < 0.02
    assert got["rloo"] > 0.10 and got["gspo"] > 0.10
