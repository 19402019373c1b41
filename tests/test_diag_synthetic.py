"""Synthetic check of the whole diagnostic chain against the Gaussian theory (paper section gaussian).

S_L ~ N(0, sigma^2 L), sigma = 0.03, L uniform on [100, 20000), advantages alternating +1/-1.
Each sequence's tokens carry d_t = S/L, so the real clip rules (FSPOClip, RLOOClip, GSPOClip with the
paper's settings) see exactly S (and S/L for GSPO); their ClipResults go through FairnessMetrics.

The paper's LRE (``fairness/lre``) uses the acceptance event (ratio inside the band, either sign of
A): P(out | L) = upper(L) + lower(L), the closed forms of fspo.clipping.theory, and
``band/out_frac/<bin>`` is that c(L). The binding LRE (``fairness/binding_lre``): a clip binds only on
the side that matches the advantage sign (A > 0: upper; A < 0: lower, plus dual), so with balanced
signs P(bind | L) = 0.5 upper(L) + 0.5 (lower(L) + dual(L)); under this model (and 1000-token bins)
the theory gives binding LRE(RLOO) ~ 0.078 and (GSPO) ~ 0.044, FSPO 0.
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


def _out_prob(rule: str, L: np.ndarray) -> np.ndarray:
    """P(the ratio is outside the band | L), either sign of A: the paper's c(L)."""
    if rule == "fspo":
        return c_fspo(L, SIGMA, 0.03, 0.03)
    if rule == "rloo":
        return c_rloo(L, SIGMA, 0.667, 0.4)
    return c_gspo(L, SIGMA, 4e-4, 3e-4)


def _theory_lre(rule, L, pos, binding=True):
    p = _bind_prob(rule, L.astype(np.float64), pos) if binding else _out_prob(rule, L.astype(np.float64))
    idx = BINS.index(torch.as_tensor(L)).numpy()
    n = np.bincount(idx, minlength=BINS.n_bins).astype(np.float64)
    c = np.bincount(idx, weights=p, minlength=BINS.n_bins)
    q = np.where(n > 0, 1 - c / np.maximum(n, 1), 1.0)
    return float(lre(torch.as_tensor(q), torch.as_tensor(n))), float(p.mean())


@pytest.mark.slow
def test_binding_lre_per_rule_matches_theory_and_fspo_is_fair(runs):
    L, pos, out = runs
    got = {k: v[1]["fairness/binding_lre"] for k, v in out.items()}
    print("observed binding LRE", got, "theory", {k: _theory_lre(k, L, pos)[0] for k in out})
    for name, (_, m) in out.items():
        theory_lre, theory_frac = _theory_lre(name, L, pos)
        assert m["fairness/binding_lre"] == pytest.approx(theory_lre, abs=0.015), name
        sd = math.sqrt(theory_frac * (1 - theory_frac) / N)
        assert abs(m["clip/seq_frac"] - theory_frac) < 4 * sd, name
        assert m["fairness/binding_lre_w"] == pytest.approx(m["fairness/binding_lre"], abs=1e-12)  # |A| = 1
    assert got["fspo"] < 0.02
    assert got["rloo"] > 0.06 and got["gspo"] > 0.03
    assert got["rloo"] > 4 * got["fspo"] and got["gspo"] > 3 * got["fspo"]


@pytest.mark.slow
def test_paper_lre_from_acceptance_matches_theory(runs):
    """``fairness/lre`` (acceptance, either sign of A) and ``band/out_frac/<bin>`` against the
    closed-form c(L): the paper's claim, LRE(FSPO) ~ 0 while RLOO and GSPO are far from fair."""
    L, pos, out = runs
    got = {k: v[1]["fairness/lre"] for k, v in out.items()}
    print("observed LRE", got, "theory", {k: _theory_lre(k, L, pos, binding=False)[0] for k in out})
    idx = BINS.index(torch.as_tensor(L)).numpy()
    for name, (_, m) in out.items():
        theory_lre, theory_frac = _theory_lre(name, L, pos, binding=False)
        assert m["fairness/lre"] == pytest.approx(theory_lre, abs=0.015), name
        assert m["fairness/lre_w"] == pytest.approx(m["fairness/lre"], abs=1e-12)  # |A| = 1
        sd = math.sqrt(theory_frac * (1 - theory_frac) / N)
        assert abs(m["band/out_frac"] - theory_frac) < 4 * sd, name
        assert m["band/n_seq"] == N
        for b, lab in enumerate(BINS.labels[:-1]):
            c = _out_prob(name, L[idx == b].astype(np.float64)).mean()
            n = int((idx == b).sum())
            assert abs(m[f"band/out_frac/{lab}"] - c) < 4 * math.sqrt(c * (1 - c) / n) + 1e-9, (name, lab)
    assert got["fspo"] < 0.02
    assert got["rloo"] > 0.10 and got["gspo"] > 0.10


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
def test_in_band_is_the_union_of_both_signs_binding():
    """The paper's acceptance event A_L = {|S| <= b_L} (section lre) is two-sided. Scoring every
    sequence with A = +1 and with A = -1, it is clipped on one side or the other exactly when it is
    out of band (for A < 0 the dual bound is >= the upper bound), so ``~in_band`` equals the union
    of the two binding masks, and the LRE from it (FairnessMetrics' ``fairness/lre`` with any sign
    of A) is < 0.02 for FSPO while RLOO and GSPO are > 0.10 (L uniform on [100, 20000))."""
    g = torch.Generator().manual_seed(99)
    n = 8000
    L = torch.randint(100, 20000, (n,), generator=g)
    S = torch.randn(n, generator=g, dtype=torch.float64) * SIGMA * L.double().sqrt()
    A = torch.where(torch.arange(n) % 3 == 0, 1.0, -1.0)  # unbalanced signs: acceptance ignores them
    got = {}
    for name, rule in (("fspo", FSPOClip()), ("rloo", RLOOClip()), ("gspo", GSPOClip())):
        fm = FairnessMetrics(BINS, reservoir_size=256)
        for ch in torch.argsort(L).split(200):
            Lc = L[ch]
            mask = torch.arange(int(Lc.max()))[None] < Lc[:, None]
            lp = (S[ch] / Lc.double()).float()[:, None] * mask
            pos = rule(lp, torch.zeros_like(lp), torch.ones(len(ch)), mask.long())
            neg = rule(lp, torch.zeros_like(lp), -torch.ones(len(ch)), mask.long())
            assert torch.equal(pos.in_band, neg.in_band)
            assert torch.equal((pos.clipped | neg.clipped) & mask, ~pos.in_band & mask)
            res = rule(lp, torch.zeros_like(lp), A[ch], mask.long())
            fm.update_clip(res, Lc, mask.long(), A[ch])
        got[name] = fm.compute()["fairness/lre"]
    print("two-sided LRE", got)
    assert got["fspo"] < 0.02
    assert got["rloo"] > 0.10 and got["gspo"] > 0.10
