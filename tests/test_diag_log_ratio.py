"""LogRatioStats: hand-computed sigma_hat and per-bin moments, exact Q-Q cases, the reservoir, bounded memory."""
import math

import pytest
import torch

from fspo.clipping.base import ClipResult
from fspo.diagnostics import FairnessMetrics, LengthBins, LogRatioStats, normal_quantiles
from fspo.diagnostics.log_ratio import _hash_uniform

BINS = LengthBins(edges=[0, 10, 100])  # [0,10), [10,100), [100,inf)


def _f64(x):
    return torch.tensor(x, dtype=torch.float64)


def test_sigma_hat_and_bin_moments_by_hand():
    m = LogRatioStats(BINS, reservoir_size=0)
    # bin [0,10): S = (0.3, -0.1, 0.1), L = (4, 1, 9): mu = 0.1; sum (S-mu)^2/L = 0.04/4 + 0.04/1 + 0 = 0.05
    # bin [10,100): S = (1, -1), L = (25, 25): mu = 0; sum = 2/25 = 0.08
    m.update(_f64([0.3, -0.1, 0.1]), torch.tensor([4, 1, 9]))
    m.update(_f64([1.0, -1.0, 7.0]), torch.tensor([25, 25, 0]))  # the L = 0 row is ignored
    out = m.compute()
    assert out["logratio/sigma_hat"] == pytest.approx(math.sqrt(0.13 / 5), rel=1e-12)
    # unbiased: D = sum_b n - 2 + (sum L)(sum 1/L)/n^2 = (1 + 14 (1/4 + 1 + 1/9)/9) + (0 + 50 (2/25)/4)
    d = 1 + 14 * (0.25 + 1 + 1 / 9) / 9 + 1
    assert out["logratio/sigma_hat_unbiased"] == pytest.approx(math.sqrt(0.13 / d), rel=1e-12)
    assert out["logratio/mean/len_00000_00010"] == pytest.approx(0.1, rel=1e-12)
    assert out["logratio/mean/len_00010_00100"] == pytest.approx(0.0, abs=1e-15)
    assert out["logratio/std/len_00000_00010"] == pytest.approx(0.2, rel=1e-12)  # sample std
    assert out["logratio/std/len_00010_00100"] == pytest.approx(math.sqrt(2), rel=1e-12)
    slope = math.log(math.sqrt(2) / 0.2) / math.log(25 / (14 / 3))
    assert out["logratio/std_exponent"] == pytest.approx(slope, rel=1e-12)
    assert out["logratio/n"] == 5.0
    assert not any(k.startswith("logratio/qq") for k in out)  # reservoir_size = 0
    assert not any("len_00100_inf" in k for k in out)  # empty bin omitted


def test_unbiased_sigma_equal_lengths_is_bessel():
    m = LogRatioStats(LengthBins(edges=[0, 100]), reservoir_size=0)
    s = _f64([0.5, -0.1, 0.2, 0.6])
    m.update(s, torch.full((4,), 16))
    out = m.compute()
    # equal L: sigma_unbiased = sample std of S / sqrt(L); sigma_hat = population std / sqrt(L)
    assert out["logratio/sigma_hat_unbiased"] == pytest.approx(float(s.std()) / 4, rel=1e-12)
    assert out["logratio/sigma_hat"] == pytest.approx(float(s.std(unbiased=False)) / 4, rel=1e-12)


def test_std_exponent_exactly_half():
    bins = LengthBins(width=100, max_len=1000)
    m = LogRatioStats(bins, reservoir_size=0)
    for L in (50, 150, 420, 999, 5000):
        a = 0.03 * math.sqrt(L)
        m.update(_f64([a, -a, a, -a]), torch.full((4,), L))
    out = m.compute()
    assert out["logratio/std_exponent"] == pytest.approx(0.5, abs=1e-12)
    # std exactly c L^0.5 (c = 0.03 * sqrt(4/3), the sample std of (a, -a, a, -a) being a sqrt(4/3)): R^2 = 1
    assert out["logratio/std_exponent_r2"] == pytest.approx(1.0, abs=1e-12)
    assert out["logratio/std_prefactor"] == pytest.approx(0.03 * math.sqrt(4 / 3), rel=1e-10)
    assert out["logratio/std_exponent_bins"] == 5


def test_std_exponent_r2_by_hand():
    """Three bins, L = 1, e, e^2 (log L = 0, 1, 2) with std = 1, e, 1 (log std = 0, 1, 0): the
    log-log slope is 0, so R^2 = 0; with std = 1, e^1, e^3 (log std 0, 1, 3): slope 1.5,
    intercept -1/6, R^2 = 1.5^2 * 2 / (sum (y - 4/3)^2 = 16/9 + 1/9 + 25/9 = 42/9) = 27/28."""
    from fspo.diagnostics.log_ratio import _power_fit

    L = _f64([1.0, math.e, math.e ** 2])
    flat = _power_fit(L, _f64([1.0, math.e, 1.0]))
    assert flat["logratio/std_exponent"] == pytest.approx(0.0, abs=1e-12)
    assert flat["logratio/std_exponent_r2"] == pytest.approx(0.0, abs=1e-12)
    bent = _power_fit(L, _f64([1.0, math.e, math.e ** 3]))
    assert bent["logratio/std_exponent"] == pytest.approx(1.5, rel=1e-12)
    assert bent["logratio/std_exponent_r2"] == pytest.approx(27 / 28, rel=1e-12)
    assert bent["logratio/std_prefactor"] == pytest.approx(math.exp(-1 / 6), rel=1e-12)
    assert bent["logratio/std_exponent_bins"] == 3


def test_qq_per_bin_standardisation_is_law_free():
    """S exactly normal-quantile shaped in each of two bins, with std growing like L^1 (not sqrt L):
    standardised by sqrt(L) sigma_hat the two bins' Z have different spreads (qq_r2 < 1); by each bin's
    own std they coincide: qq_r2_per_bin is that of the n quantiles taken twice (a linear map of Z
    leaves R^2 unchanged)."""
    n = 401
    q = normal_quantiles(n)
    m = LogRatioStats(LengthBins(edges=[0, 100, 1000]), reservoir_size=2048)
    m.update(torch.cat([0.01 * 50 * q, 0.01 * 500 * q]), torch.cat([torch.full((n,), 50), torch.full((n,), 500)]))
    out = m.compute()
    from fspo.diagnostics.log_ratio import _qq_fit

    twice = _qq_fit(torch.cat([q, q]))["logratio/qq_r2"]  # the n quantiles taken twice: 0.99984
    assert twice > 0.9998
    assert out["logratio/qq_r2_per_bin"] == pytest.approx(twice, abs=1e-12)
    assert out["logratio/qq_r2"] < 0.97
    assert out["logratio/std_exponent"] == pytest.approx(1.0, abs=1e-12)


def test_qq_exact_on_normal_quantiles():
    n = 999
    q = normal_quantiles(n)
    L = torch.full((n,), 400)
    m = LogRatioStats(LengthBins(edges=[0, 1000]), reservoir_size=1024)
    m.update(0.03 * 20 * q, L)  # S = sigma sqrt(L) q
    out = m.compute()
    rms = float(q.pow(2).mean().sqrt())
    assert out["logratio/sigma_hat"] == pytest.approx(0.03 * rms, rel=1e-12)
    assert out["logratio/qq_r2"] == pytest.approx(1.0, abs=1e-12)
    assert out["logratio/qq_slope"] == pytest.approx(1 / rms, rel=1e-10)
    assert out["logratio/qq_intercept"] == pytest.approx(0.0, abs=1e-12)
    assert out["logratio/qq_n"] == n


@pytest.mark.parametrize("bad,msg", [("nan", "seq_log_ratio contains NaN at 3 positions; check log-probs upstream"),
                                     ("inf", "seq_log_ratio contains inf at 3 positions")])
def test_non_finite_inputs_raise(bad, msg):
    s = torch.zeros(6)
    s[[0, 2, 5]] = float(bad)
    with pytest.raises(ValueError, match=msg):
        LogRatioStats(BINS).update(s, torch.ones(6, dtype=torch.long))
    with pytest.raises(ValueError, match="shape"):
        LogRatioStats(BINS).update(torch.zeros(2), torch.ones(3, dtype=torch.long))


def test_empty_batches_and_zero_lengths():
    m = LogRatioStats(BINS, reservoir_size=8)
    m.update(torch.zeros(0), torch.zeros(0, dtype=torch.long))
    m.update(torch.tensor([0.0, 0.0]), torch.zeros(2, dtype=torch.long))
    assert m.compute() == {}
    assert int(m.n_seen) == 0 and int((m.res_len > 0).sum()) == 0


def _reference_algorithm_r(s, K, seed):
    """Sequential Algorithm R with the same per-item draws (hash of (seed, n))."""
    res = [None] * K
    for n, v in enumerate(s):
        if n < K:
            res[n] = v
        else:
            j = int(math.floor(float(_hash_uniform(torch.tensor([n]), seed)[0]) * (n + 1)))
            if j < K:
                res[j] = v
    return res


def test_reservoir_matches_sequential_algorithm_r_and_is_split_invariant():
    N, K = 500, 16
    s = torch.arange(N, dtype=torch.float64) + 1
    one, many = LogRatioStats(BINS, reservoir_size=K, seed=3), LogRatioStats(BINS, reservoir_size=K, seed=3)
    one.update(s, torch.full((N,), 5))
    for sl in torch.arange(N).split(23):
        many.update(s[sl], torch.full((len(sl),), 5))
    assert one.res_s.tolist() == _reference_algorithm_r(s.tolist(), K, 3)
    for name in one._defaults:
        torch.testing.assert_close(getattr(one, name), getattr(many, name), rtol=1e-13, atol=0)


def test_reservoir_is_uniform():
    N, K = 100_000, 4096
    m = LogRatioStats(BINS, reservoir_size=K, seed=0)
    for sl in torch.arange(N).split(7_000):
        m.update(sl.double(), torch.full((len(sl),), 50))
    kept = m.res_s
    assert int((m.res_len > 0).sum()) == K and kept.unique().numel() == K
    # uniform on 0..N-1: mean (N-1)/2, sd of the sample mean ~ N/sqrt(12 K) = 451
    assert abs(float(kept.mean()) - (N - 1) / 2) < 4 * N / math.sqrt(12 * K)
    late = float((kept >= N - 10_000).double().mean())  # last 10% of the stream ~ 10% of the sample
    assert abs(late - 0.1) < 4 * math.sqrt(0.09 / K)


def _state_shapes(fm):
    return {f"{mod}.{name}": (tuple(getattr(m, name).shape), getattr(m, name).dtype)
            for mod, m in fm.named_children() for name in m._defaults}


def test_bounded_memory_ten_million_sequences():
    """10M sequences in 100 batches of 100k: every state keeps its shape and dtype.

    Lengths span every bin (overflow included) for the [B]-input metrics; the clip masks use
    T = 1 to keep the test fast (the state shapes do not depend on T)."""
    bins = LengthBins(width=200, max_len=32768)
    fm = FairnessMetrics(bins, reservoir_size=4096)
    before = _state_shapes(fm)
    g = torch.Generator().manual_seed(0)
    B = 100_000
    L = torch.randint(0, 40_000, (B,), generator=g)
    s = torch.randn(B, generator=g) * 0.03 * L.float().sqrt()
    L1 = (L > 0).long()  # T = 1 masks for the clip counts
    m1 = L1[:, None].bool()
    up = m1 & (torch.rand(B, 1, generator=g) < 0.2)
    no = torch.zeros(B, 1, dtype=torch.bool)
    res = ClipResult(torch.zeros(1), s, up, no, no, m1 & ~up)
    adv, overlong = torch.ones(B), L >= 32_768
    for _ in range(100):  # 10 million sequences
        fm.clip.update(L1, m1, res.clip_upper, res.clip_lower, res.clip_dual, adv, in_band=res.in_band,
                       clip_cap=res.clip_cap)
        fm.log_ratio.update(s, L)
        fm.update_rollout(L, overlong)
    assert _state_shapes(fm) == before
    out = fm.compute()
    assert _state_shapes(fm) == before
    assert out["rollout/n_responses"] == 10_000_000
    assert int(fm.log_ratio.n_seen) == 100 * int((L > 0).sum())
    assert out["logratio/qq_n"] == 4096
    assert out["logratio/sigma_hat"] == pytest.approx(0.03, rel=0.01)
    assert out["clip/seq_frac"] == pytest.approx(int(up.sum()) / int(m1.sum()), rel=1e-12)
    assert out["band/out_frac"] == pytest.approx(int(up.sum()) / int(m1.sum()), rel=1e-12)
