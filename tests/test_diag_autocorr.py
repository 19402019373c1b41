"""TokenLogRatioACF: hand-computed lag autocorrelations, the trapezoid tau and the position profile,
and FairnessMetrics passing per-token log-ratios through (the measurement behind the per-token autocorrelation)."""
import math

import pytest
import torch

from fspo.diagnostics import FairnessMetrics, LengthBins
from fspo.diagnostics.autocorr import TokenLogRatioACF


def _f64(x):
    return torch.tensor(x, dtype=torch.float64)


def test_alternating_signs_by_hand():
    """d = (1, -1, 1, -1) and (2, -2, 2) (mask cuts the second at 3 tokens).
    Lag 0: 7 values, sum d^2 = 4 + 12 = 16, sum d = 0 + 2 = 2: cov_0 = 16/7 - (2/7)^2 = 108/49.
    Lag 1: pairs (1,-1)(-1,1)(1,-1) and (2,-2)(-2,2): n = 5, sum prod = -3 - 8 = -11, left sums
    1-1+1+2-2 = 1, right -1+1-1-2+2 = -1: cov_1 = -11/5 + 1/25 = -54/25; rho_1 = -(54/25)/(108/49) = -49/50.
    Lag 2: pairs (1,1)(-1,-1) and (2,2): n = 3, prod 1 + 1 + 4 = 6, left 1 - 1 + 2 = 2, right 2:
    cov_2 = 2 - 4/9 = 14/9; rho_2 = (14/9)/(108/49) = 686/972."""
    m = TokenLogRatioACF(LengthBins(edges=[1, 3]), lags=(1, 2))
    d = _f64([[1, -1, 1, -1], [2, -2, 2, 9]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    m.update(d, mask)
    out = m.compute()
    rho1, rho2 = -49 / 50, 686 / 972
    assert out["logratio/tok_std"] == pytest.approx(math.sqrt(108 / 49), rel=1e-12)
    assert out["logratio/acf/lag_0001"] == pytest.approx(rho1, rel=1e-12)
    assert out["logratio/acf/lag_0002"] == pytest.approx(rho2, rel=1e-12)
    # trapezoid over k = 0, 1, 2 (unit gaps): 2 * ((1 + rho1)/2 + (rho1 + rho2)/2) = 1 + 2 rho1 + rho2
    assert out["logratio/acf_tau"] == pytest.approx(1 + 2 * rho1 + rho2, rel=1e-12)
    # positions 1..2 (tokens t = 0, 1) and 3.. (t >= 2): values (1, -1, 2, -2) and (1, -1, 2)
    assert out["logratio/tok_std/pos_00001_00003"] == pytest.approx(math.sqrt(10 / 3), rel=1e-12)
    assert out["logratio/tok_std/pos_00003_inf"] == pytest.approx(float(_f64([1, -1, 2]).std()), rel=1e-12)


def test_split_updates_are_exact_and_independent_tokens_give_tau_near_one():
    g = torch.Generator().manual_seed(0)
    d = torch.randn(64, 400, generator=g, dtype=torch.float64)
    mask = torch.ones(64, 400, dtype=torch.long)
    one = TokenLogRatioACF(LengthBins(width=100, max_len=400))
    two = TokenLogRatioACF(LengthBins(width=100, max_len=400))
    one.update(d, mask)
    two.update(d[:20], mask[:20])
    two.update(d[20:], mask[20:])
    a, b = one.compute(), two.compute()
    assert a.keys() == b.keys() and all(a[k] == pytest.approx(b[k], rel=1e-10, abs=1e-14) for k in a)
    assert all(abs(a[f"logratio/acf/lag_{k:04d}"]) < 0.02 for k in (1, 2, 4, 8, 16, 32, 64, 128))
    # a random walk's increments summed in blocks: d_t = e_t + e_{t-1} has rho_1 = 1/2, rho_k = 0 beyond
    e = torch.randn(64, 401, generator=g, dtype=torch.float64)
    ma = TokenLogRatioACF(LengthBins(width=100, max_len=400), lags=(1, 2))
    ma.update(e[:, 1:] + e[:, :-1], mask)
    out = ma.compute()
    assert out["logratio/acf/lag_0001"] == pytest.approx(0.5, abs=0.02)
    assert out["logratio/acf/lag_0002"] == pytest.approx(0.0, abs=0.02)


def test_fairness_metrics_measures_token_ratios_only_when_given_and_off_policy():
    from fspo.clipping.fspo import FSPOClip

    fm = FairnessMetrics(LengthBins(width=2, max_len=4))
    logp = _f64([[0.1, -0.2, 0.3], [0.0, 0.2, 0.0]]).float()
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    res = FSPOClip()(logp, torch.zeros_like(logp), torch.tensor([1.0, -1.0]), mask)
    fm.update_clip(res, None, mask, torch.tensor([1.0, -1.0]), log_ratio=False, token_log_ratio=logp)
    assert not any(k.startswith("logratio/acf") for k in fm.compute())  # on-policy: not measured
    fm.update_clip(res, None, mask, torch.tensor([1.0, -1.0]), token_log_ratio=logp)
    out = fm.compute()
    assert "logratio/acf/lag_0001" in out and out["logratio/tok_std"] > 0
