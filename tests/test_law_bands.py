"""Bands on S judged on the same sequences (fspo/diagnostics/law_bands.py), by hand and on simulated laws."""
import math

import numpy as np
import pytest

from fspo.diagnostics import law_bands as lb
from fspo.diagnostics import law_stats as st


def test_matched_bands_equal_at_the_median_length():
    b = lb.matched_bands(0.03, 100.0)  # xi = 0.03 sqrt(100) = 0.3
    for name in ("fspo", "rloo", "gspo"):
        lo, hi = b[name].limits(np.array([100.0]))
        assert lo[0] == pytest.approx(-0.3) and hi[0] == pytest.approx(0.3), name
    L = np.array([400.0])
    assert b["fspo"].limits(L)[1][0] == pytest.approx(0.6)   # c sqrt(L)
    assert b["rloo"].limits(L)[1][0] == pytest.approx(0.3)   # fixed on S
    assert b["gspo"].limits(L)[1][0] == pytest.approx(1.2)   # fixed on S / L


def test_judge_counts_and_ratios_by_hand():
    L = np.array([30.0] * 100 + [300.0] * 100)
    out = np.array([True] * 10 + [False] * 90 + [True] * 40 + [False] * 60)
    res = lb.judge(L, np.zeros(200), out, [24, 48, 96, 192, 384], min_count=50)
    assert res["n"] == [100, 100] and res["k"] == [10, 40] and res["c"] == [0.1, 0.4]
    assert res["ratio_last_first"] == pytest.approx(4.0) and res["ratio_first_last"] == pytest.approx(0.25)
    assert res["span"] == pytest.approx(10.0)
    assert res["lre"] == pytest.approx(st.lre_from_counts([10, 40], [100, 100]))
    assert res["p_homogeneity"] < 1e-5


def test_ratio_with_an_empty_last_bin_is_infinite_not_missing():
    L = np.array([30.0] * 100 + [300.0] * 100)
    out = np.array([True] * 10 + [False] * 190)
    assert lb.judge(L, np.zeros(200), out, [24, 48, 96, 192, 384], 50)["ratio_first_last"] == math.inf


def _law(rng, n, tau2=0.0, sigma=0.05, drift=0.0):
    L = 6.0 * np.floor(np.exp(rng.uniform(math.log(4), math.log(101), n)))
    return L, rng.normal(drift * L, np.sqrt(tau2 + sigma ** 2 * L))


def test_under_the_law_fspo_is_flat_rloo_rises_gspo_falls():
    rng = np.random.default_rng(0)
    L, S = _law(rng, 6000)
    edges = st.geometric_edges(24, 601)
    bands = lb.matched_bands(0.05, float(np.median(L)))
    res = {k: lb.judge(L, S, lb.outside_of(b, L, S), edges, 50, b.limits(L)) for k, b in bands.items()}
    assert res["fspo"]["p_homogeneity"] > 0.01
    assert res["rloo"]["ratio_last_first"] > 3 and res["gspo"]["ratio_first_last"] > 3
    assert res["fspo"]["lre"] < 0.5 * min(res["rloo"]["lre"], res["gspo"]["lre"])
    # the Gaussian prediction from each bin's own std follows the observed c(L)
    assert np.allclose(res["rloo"]["c_gauss"], res["rloo"]["c"], atol=0.06)


def test_affine_band_fits_drift_and_both_variances():
    rng = np.random.default_rng(1)
    L, S = _law(rng, 40_000, tau2=0.5, sigma=0.1, drift=-0.002)
    band = lb.AffineBand(z=1.0).fit(L, S)
    assert band.m == pytest.approx(-0.002, abs=3e-4)
    assert band.tau2 == pytest.approx(0.5, abs=0.15) and band.sigma2 == pytest.approx(0.01, rel=0.1)


def test_out_of_sample_calibrated_band_is_flat_where_the_sqrt_band_is_not():
    # the law broken by a constant variance (tau^2 >> sigma^2 L at short L): the sqrt(L) band clips short
    # responses far more; the affine band fit on earlier steps (never on the judged step) is flat
    rng = np.random.default_rng(2)
    steps, parts = 12, []
    for t in range(steps):
        L, S = _law(rng, 400, tau2=0.3, sigma=0.02)
        parts.append((np.full(400, t), np.full(400, 1 + t % 3), L, S))
    step, update, L, S = (np.concatenate(x) for x in zip(*parts))
    oos = lb.out_of_sample(L, S, step, update, lambda: lb.AffineBand(z=1.0))
    j = oos["judged"]
    assert not j[step == 0].any() and j[step >= 4].all()
    edges = st.geometric_edges(24, 601)
    cal = lb.judge(L[j], S[j], oos["outside"][j], edges, 50)
    sqrt_band = lb.SqrtBand(math.sqrt(np.mean(S ** 2 / L)))
    sq = lb.judge(L[j], S[j], lb.outside_of(sqrt_band, L[j], S[j]), edges, 50)
    assert cal["p_homogeneity"] > 0.01 and cal["lre"] < 1.5 * cal["lre_floor"]["p95"]
    assert sq["p_homogeneity"] < 1e-6


def test_bin_quantile_band_covers_each_bin():
    rng = np.random.default_rng(4)
    L, S = _law(rng, 20_000)
    S = S * (1 + (L > 200))  # a shape change with L that no smooth law follows
    band = lb.BinQuantileBand(z=1.0).fit(L, S)
    res = lb.judge(L, S, lb.outside_of(band, L, S), st.geometric_edges(24, 601), 50)
    assert np.allclose(res["c"], 2 * 0.15865525, atol=0.03)


def test_affine_variance_band_in_loop_by_hand():
    """clip.band=affine (fspo/clipping/affine_band.py): bins at L 10 and 40 with mean squares 5 and 11 give
    sigma^2 = (11 - 5) / 30 = 0.2 and tau^2 = 5 - 0.2 x 10 = 3, so scale(25) = sqrt(3 + 5)."""
    import torch

    from fspo.clipping.affine_band import AffineVarianceBand

    band = AffineVarianceBand(alpha=1.0, min_count=1)
    s = torch.tensor([5 ** 0.5, -5 ** 0.5, 11 ** 0.5, -11 ** 0.5], dtype=torch.float64)
    band.observe(s, torch.tensor([10, 10, 40, 40]))
    tau2, sigma2 = band.fit_affine()
    assert float(tau2) == pytest.approx(3.0) and float(sigma2) == pytest.approx(0.2)
    assert band.scale(torch.tensor([0, 25])).tolist() == pytest.approx([0.0, 8 ** 0.5])
    assert band.metrics()["clip/band_l_star"] == pytest.approx(15.0)
    fresh = AffineVarianceBand(sigma0=0.03)  # no data yet: the paper's sqrt law with sigma0
    assert float(fresh.scale(torch.tensor([100]))[0]) == pytest.approx(0.3)
