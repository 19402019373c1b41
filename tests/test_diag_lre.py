"""LRE / LRE_w closed forms, length bins and the theory curves, with hand-computed expectations."""
import math

import numpy as np
import pytest
import torch
from scipy.special import ndtr

from fspo.diagnostics import (
    LengthBins,
    acceptance,
    c_fspo,
    c_fspo_symmetric,
    c_gspo,
    c_gspo_symmetric,
    c_rloo,
    c_rloo_symmetric,
    label_edges,
    length_fairness,
    lre,
    min_len_mask,
    q_bar,
)


def test_lre_two_equal_bins_is_one_sixth():
    # q = 0.5 and 1.0, equal weights: q_bar = 0.75, LRE = 0.5 * (1/3 + 1/3) / 2 = 1/6
    q = torch.tensor([0.5, 1.0])
    assert float(q_bar(q, torch.tensor([1.0, 1.0]))) == pytest.approx(0.75, abs=1e-15)
    assert float(lre(q, torch.tensor([1.0, 1.0]))) == pytest.approx(1 / 6, abs=1e-15)
    assert float(lre(q, torch.tensor([10.0, 10.0]))) == pytest.approx(1 / 6, abs=1e-15)


def test_lre_unequal_counts_by_hand():
    # n = (1, 3), q = (0.2, 0.6): q_bar = (0.2 + 1.8)/4 = 0.5; |0.4-1| = 0.6, |1.2-1| = 0.2
    # LRE = 0.5 * (1*0.6 + 3*0.2) / 4 = 0.15
    got = float(lre(torch.tensor([0.2, 0.6], dtype=torch.float64), torch.tensor([1.0, 3.0])))
    assert got == pytest.approx(0.15, abs=1e-15)


def test_lre_w_appendix_formula_by_hand():
    # counts n = (2, 2), acceptance q = (0.5, 1.0) -> q_bar (count-weighted) = 0.75
    # sum|A| per bin a = (3, 1): LRE_w = 0.5 * (3 * 1/3 + 1 * 1/3) / 4 = 1/6
    q = acceptance(torch.tensor([2, 2]), torch.tensor([1.0, 0.0]))
    assert q.tolist() == [0.5, 1.0]
    n, a = torch.tensor([2.0, 2.0]), torch.tensor([3.0, 1.0])
    assert float(lre(q, a, q_bar_weights=n)) == pytest.approx(1 / 6, abs=1e-15)
    # unequal counts: n = (1, 3), q = (0.2, 0.6), q_bar = 0.5; a = (4, 1) (mean |A| 4 vs 1/3)
    # LRE_w = 0.5 * (4 * 0.6 + 1 * 0.2) / 5 = 0.26; appendix form: E_L[|.| g_L] / E_L[g_L] with
    # p = (1/4, 3/4), g = (4, 1/3): (0.25*0.6*4 + 0.75*0.2/3) / (0.25*4 + 0.75/3) * 0.5 = 0.26
    q2, n2, a2 = torch.tensor([0.2, 0.6], dtype=torch.float64), torch.tensor([1.0, 3.0]), torch.tensor([4.0, 1.0])
    assert float(lre(q2, a2, q_bar_weights=n2)) == pytest.approx(0.26, abs=1e-15)
    p, g = np.array([0.25, 0.75]), np.array([4.0, 1 / 3])
    appendix = 0.5 * (p * np.abs(np.array([0.2, 0.6]) / 0.5 - 1) * g).sum() / (p * g).sum()
    assert appendix == pytest.approx(0.26, abs=1e-15)


def test_lre_degenerate_cases_are_zero_not_nan():
    assert float(lre(torch.tensor([0.0, 0.0]), torch.tensor([3.0, 1.0]))) == 0.0  # everything clipped
    assert float(lre(torch.tensor([0.5, 1.0]), torch.tensor([0.0, 0.0]))) == 0.0  # no weight
    assert float(lre(torch.tensor([]), torch.tensor([]))) == 0.0
    assert float(q_bar(torch.tensor([0.3]), torch.tensor([0.0]))) == 0.0
    # zero-weight bins do not enter: a third empty bin with any q changes nothing
    assert float(lre(torch.tensor([0.5, 1.0, 0.0]), torch.tensor([1.0, 1.0, 0.0]))) == pytest.approx(1 / 6)
    with pytest.raises(ValueError, match="non-negative"):
        lre(torch.tensor([0.5]), torch.tensor([-1.0]))
    # empty bins get q = 1 from acceptance (never NaN)
    assert acceptance(torch.tensor([0, 4]), torch.tensor([0.0, 1.0])).tolist() == [1.0, 0.75]


def test_length_fairness_min_len_excludes_bins_by_upper_edge():
    bins = LengthBins(width=200, max_len=1400)  # 0,200,...,1400 + overflow
    assert min_len_mask(bins, 1000).tolist() == [False] * 5 + [True, True, True]
    counts = torch.zeros(bins.n_bins)
    clipped = torch.zeros(bins.n_bins)
    counts[0], clipped[0] = 10, 10  # fully clipped short bin: excluded by min_len
    counts[5], clipped[5] = 4, 2  # [1000, 1200): q = 0.5
    counts[7], clipped[7] = 4, 0  # overflow [1400, inf): q = 1
    abs_adv = counts.clone()
    out = length_fairness(counts, clipped, abs_adv, bins, min_len=1000)
    assert out == pytest.approx({"fairness/lre": 1 / 6, "fairness/lre_w": 1 / 6, "fairness/q_bar": 0.75,
                                 "fairness/n_bins": 2.0})
    # without min_len the short bin enters: q = (0, 0.5, 1), n = (10, 4, 4): q_bar = 6/18 = 1/3
    # LRE = 0.5 * (10*1 + 4*0.5 + 4*2) / 18 = 10/18
    assert length_fairness(counts, clipped, abs_adv, bins)["fairness/lre"] == pytest.approx(10 / 18)
    assert length_fairness(torch.zeros(8), torch.zeros(8), torch.zeros(8), bins) == {}
    # the binding-clip LRE goes through the same function under its own names
    assert length_fairness(counts, clipped, abs_adv, bins, min_len=1000, prefix="fairness/binding_") == \
        pytest.approx({"fairness/binding_lre": 1 / 6, "fairness/binding_lre_w": 1 / 6,
                       "fairness/binding_q_bar": 0.75, "fairness/binding_n_bins": 2.0})


def test_length_bins_edges_labels_and_index():
    b = LengthBins()  # paper bins: width 200 up to 32768
    assert b.edges[:3] == (0, 200, 400) and b.edges[-2:] == (32600, 32768)
    assert b.labels[1] == "len_00200_00400" and b.labels[-1] == "len_32768_inf"
    assert b.labels[-2] == "len_32600_32768"
    idx = b.index(torch.tensor([0, 1, 199, 200, 32767, 32768, 10**6]))
    assert idx.tolist() == [-1, 0, 0, 1, b.n_bins - 2, b.n_bins - 1, b.n_bins - 1]
    e = LengthBins(edges=[100, 1000, 5000])
    assert e.labels == ["len_00100_01000", "len_01000_05000", "len_05000_inf"]
    assert e.index(torch.tensor([50, 100, 999, 1000, 7000])).tolist() == [-1, 0, 0, 1, 2]
    assert e.upper == [1000.0, 5000.0, math.inf]
    assert label_edges("len_00200_00400") == (200.0, 400.0)
    assert label_edges("len_32768_inf") == (32768.0, math.inf)


@pytest.mark.parametrize("kw,msg", [
    (dict(edges=[0, 200, 200]), "strictly increasing"),
    (dict(edges=[400, 200]), "strictly increasing"),
    (dict(edges=[-1, 5]), "non-negative"),
    (dict(edges=[0, 2.5]), "integers"),
    (dict(edges=[]), "at least one"),
    (dict(width=0), "width"),
    (dict(width=10, max_len=-5), "max_len"),
])
def test_length_bins_validation(kw, msg):
    with pytest.raises(ValueError, match=msg):
        LengthBins(**kw)


def test_theory_symmetric_forms_equal_exact_forms_at_zero_drift():
    L = np.array([1.0, 100.0, 1000.0, 18000.0])
    sigma, eps = 0.03, 0.667
    xi = math.log1p(eps)
    np.testing.assert_allclose(c_rloo(L, sigma, eps), c_rloo_symmetric(L, sigma, xi), rtol=1e-12)
    np.testing.assert_allclose(c_gspo(L, sigma, eps), c_gspo_symmetric(L, sigma, xi), rtol=1e-12)
    np.testing.assert_allclose(c_fspo(L, z=1.0), c_fspo_symmetric(L, 1.0), rtol=1e-12)
    np.testing.assert_allclose(c_fspo(L, z=1.0), 0.31731050786291415, rtol=1e-12)  # 2 Phi(-1)
    np.testing.assert_allclose(c_fspo(L, 0.03, 0.03), 0.31731050786291415, rtol=1e-12)  # c = z sigma


def test_theory_asymmetric_by_hand():
    # RLOO paper band [0.6, 1.667] at L = 100, sigma = 0.03: s = 0.3
    up, lo = c_rloo(100, 0.03, 0.667, 0.4, parts=True)
    assert float(up) == pytest.approx(ndtr(-math.log(1.667) / 0.3), rel=1e-12)
    assert float(lo) == pytest.approx(ndtr(math.log(0.6) / 0.3), rel=1e-12)
    # GSPO at L = 10,000: S/L has sd 0.03/100 = 3e-4
    g = c_gspo(10_000, 0.03, 4e-4, 3e-4)
    assert float(g) == pytest.approx(ndtr(-math.log1p(4e-4) / 3e-4) + ndtr(math.log1p(-3e-4) / 3e-4), rel=1e-12)
    # FSPO asymmetric and drift: S ~ N(-0.001 L, 0.03^2 L), band [-0.02 sqrt L, 0.04 sqrt L], L = 400
    f = c_fspo(400, 0.03, 0.04, 0.02, mu=-0.001)
    assert float(f) == pytest.approx(ndtr(-(0.8 + 0.4) / 0.6) + ndtr((-0.4 + 0.4) / 0.6), rel=1e-12)
    # vectorised; L = 0 is never clipped
    assert c_rloo([0, 10, 20], 0.03, 0.2).shape == (3,)
    assert float(c_rloo(0, 0.03, 0.2)) == 0.0 and float(c_gspo(0, 0.03, 0.2)) == 0.0
    assert float(c_fspo(0, 0.03, 0.03)) == 0.0
    # monotone: RLOO grows with L, GSPO shrinks, FSPO flat
    L = np.array([100.0, 1000.0, 10000.0])
    assert np.all(np.diff(c_rloo(L, 0.03, 0.667, 0.4)) > 0)
    assert np.all(np.diff(c_gspo(L, 0.03, 4e-4, 3e-4)) < 0)
    assert np.ptp(c_fspo(L, 0.03, 0.03)) < 1e-12
    # zero tolerance on a side is legal (verl allows clip_ratio_low = 0): band edge at S = 0
    assert float(c_rloo(100, 0.03, 0.2, 0.0, parts=True)[1]) == pytest.approx(0.5, abs=1e-15)
    with pytest.raises(ValueError, match="eps_lower"):
        c_rloo(10, 0.03, 0.2, 1.5)
    with pytest.raises(ValueError, match="z="):
        c_fspo(10)
