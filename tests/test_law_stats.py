"""The length law's statistics (fspo/diagnostics/law_stats.py) against hand-computed values."""
import math

import numpy as np
import pytest
from scipy import stats

from fspo.diagnostics import law_stats as st


def test_geometric_edges_two_per_octave():
    # 24, 24 sqrt2 = 33.9, 48, 67.9, 96, 135.8: the first edge >= 100 ends the list
    assert st.geometric_edges(24, 100, 2) == [24, 34, 48, 68, 96, 136]
    with pytest.raises(ValueError, match="0 < lo < hi"):
        st.geometric_edges(0, 10)


def test_bin_index_half_open_and_outside():
    idx = st.bin_index(np.array([24, 33, 34, 135, 136, 10]), [24, 34, 48, 68, 96, 136])
    assert idx.tolist() == [0, 0, 1, 4, -1, -1]


def _two_bins():
    # bin [24, 34): S 1, 3 (mean 2, var 2); bin [48, 68): S 2, 6 (mean 4, var 8); bin [34, 48) empty
    return st.bin_moments([30, 30, 50, 50], [1.0, 3.0, 2.0, 6.0], [24, 34, 48, 68], sum_d2=[1.0, 3.0, 4.0, 12.0])


def test_bin_moments_by_hand():
    m = _two_bins()
    assert m.n.tolist() == [2, 0, 2]
    assert m.mean_s.tolist() == [2, 0, 4] and m.var_s.tolist() == [2, 0, 8]
    assert m.mean_d2.tolist() == [2, 0, 8]


def test_std_exponent_two_bins():
    # gamma = (ln sqrt8 - ln sqrt2) / (ln 50 - ln 30) = 0.5 ln 4 / ln(5/3)
    fit = st.std_exponent(_two_bins(), min_count=2)
    assert fit["exponent"] == pytest.approx(0.5 * math.log(4) / math.log(5 / 3), rel=1e-12)
    assert fit["r2"] == pytest.approx(1.0) and fit["bins"] == 2
    assert st.std_exponent(_two_bins(), min_count=3)["exponent"] is None  # no bin has 3 sequences


def test_affine_variance_exact_on_two_bins():
    # var 4 at L 30 and 6 at L 50: sigma^2 = 0.1, tau^2 = 1, L* = 10 (exact: two points, any weights)
    m = st.BinMoments([24, 34, 48, 68], np.array([5.0, 0, 9.0]), np.array([30.0, 0, 50.0]), np.zeros(3),
                      np.array([4.0, 0, 6.0]))
    fit = st.affine_variance(m, min_count=2)
    assert fit["sigma2"] == pytest.approx(0.1) and fit["tau2"] == pytest.approx(1.0)
    assert fit["l_star"] == pytest.approx(10.0)


def test_affine_variance_recovers_a_simulated_law():
    rng = np.random.default_rng(0)
    L = rng.integers(20, 600, 40_000).astype(float)
    S = rng.normal(0, np.sqrt(0.5 + 0.01 * L))
    fit = st.affine_variance(st.bin_moments(L, S, st.geometric_edges(20, 600)), 50)
    assert fit["tau2"] == pytest.approx(0.5, abs=0.15) and fit["sigma2"] == pytest.approx(0.01, rel=0.05)


def test_variance_inflation_is_one_for_matching_moments():
    assert st.variance_inflation(_two_bins(), 2)["pooled"] == pytest.approx((2 * 2 + 2 * 8) / (2 * 2 + 2 * 8))


def test_wilson_by_hand():
    lo, hi = st.wilson(np.array([5, 0]), np.array([10, 10]))
    z2 = stats.norm.ppf(0.975) ** 2
    assert lo[0] == pytest.approx(0.2366, abs=1e-4) and hi[0] == pytest.approx(0.7634, abs=1e-4)
    assert lo[1] == 0 and hi[1] == pytest.approx(z2 / (10 + z2))


def test_homogeneity_and_lre_by_hand():
    assert st.homogeneity_p([10, 10], [100, 100]) == pytest.approx(1.0)
    # [[0, 20], [100, 80]]: chi2 = 10 + 10 + 100/90 + 100/90 with 1 degree of freedom
    assert st.homogeneity_p([0, 20], [100, 100]) == pytest.approx(stats.chi2.sf(20 + 200 / 90, 1), rel=1e-9)
    assert st.homogeneity_p([0, 0], [100, 100]) == 1.0
    # q = 1, 0.5; q_bar = 0.75; |q / q_bar - 1| = 1/3 in both bins
    assert st.lre_from_counts([0, 50], [100, 100]) == pytest.approx(1 / 6)


def test_lre_noise_floor_is_the_lre_of_a_flat_band():
    floor = st.lre_noise_floor(np.array([200] * 8), 0.3, n_sim=4000, seed=1)
    # |k/n - p| has mean ~ sqrt(2 p (1 - p) / (pi n)); LRE = 0.5 E|q/q_bar - 1| with q_bar = 0.7
    approx = 0.5 * math.sqrt(2 * 0.3 * 0.7 / (math.pi * 200)) / 0.7
    assert floor["mean"] == pytest.approx(approx, rel=0.1) and floor["p95"] > floor["mean"]


def test_gaussian_out_frac():
    assert st.gaussian_out_frac([10], [-1.0], [1.0], 0.0, 1.0)[0] == pytest.approx(2 * stats.norm.sf(1.0))


def test_bootstrap_exponent_covers_the_truth_under_the_law():
    rng = np.random.default_rng(3)
    n = rng.integers(4, 101, 400)
    L = np.repeat(6.0 * n, 8)  # 400 prompts x 8 sequences of the same length
    S = rng.normal(0, 0.03 * np.sqrt(L))
    edges = st.geometric_edges(24, 601)
    ci = st.bootstrap_exponent(L, S, np.repeat(np.arange(400), 8), edges, 50, n_boot=100, seed=0)
    assert ci[0] < 0.5 < ci[1] and ci[1] - ci[0] < 0.2


def test_design_effect_by_hand_and_the_clustered_test():
    # one bin, two clusters of 2: verdicts (1, 1) and (0, 0): p = 1/2, cluster totals y = 2, 0 with m = 2:
    # v_cluster = J/(J-1) sum (y - p m)^2 / n^2 = 2 x (1 + 1) / 16 = 1/4; binomial p(1-p)/n = 1/16 -> deff 4
    assert st.design_effect([1, 1, 0, 0], [0, 0, 1, 1], [0, 0, 0, 0]) == pytest.approx(4.0)
    # independent-looking verdicts (one out per cluster): y = 1, 1 = p m -> deff 0
    assert st.design_effect([1, 0, 1, 0], [0, 0, 1, 1], [0, 0, 0, 0]) == pytest.approx(0.0)
    k, n = np.array([10, 20]), np.array([100, 100])
    chi2 = stats.chi2_contingency(np.stack([k, n - k]), correction=False)[0]
    assert st.homogeneity_p_clustered(k, n, 2.0) == pytest.approx(stats.chi2.sf(chi2 / 2, 1))
    assert st.homogeneity_p_clustered(k, n, 0.5) == pytest.approx(st.homogeneity_p(k, n))  # never more liberal


def test_design_effect_is_about_one_for_independent_sequences():
    rng = np.random.default_rng(7)
    out = rng.random(8000) < 0.3
    assert st.design_effect(out, np.repeat(np.arange(1000), 8), rng.integers(0, 5, 8000)) == pytest.approx(1.0, abs=0.1)
