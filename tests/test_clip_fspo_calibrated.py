"""FSPOClip with the calibrated bands (band=power | per_bin): flat acceptance where the sqrt(L) law
fails, checkpointed state, dual bound, validation. The calibrators' own estimators, forgetting and
rank-exactness are pinned in tests/test_clip_calibration.py."""
from __future__ import annotations

import math

import pytest
import torch
from hydra.utils import instantiate

from conftest import clip_config
from fspo.clipping import FSPOClip

TARGET = 2 * 0.5 * math.erfc(1 / math.sqrt(2))  # 2 Phi(-1) = 0.3173


def batch(gen, n, gamma, sigma=0.03):
    """n sequences, L log-uniform in [10, 2000], S ~ N(0, sigma^2 L^(2 gamma)) as [B] tensors."""
    L = torch.exp(torch.empty(n).uniform_(math.log(10), math.log(2000), generator=gen)).round()
    return torch.randn(n, generator=gen) * sigma * L.pow(gamma), L


def out_of_band(rule, S, L):
    lo, hi, _ = rule.bounds(L)
    return (S < lo) | (S > hi)


@pytest.mark.parametrize("band", ["power", "per_bin"])
def test_acceptance_flat_where_sqrt_law_fails(band):
    gen = torch.Generator().manual_seed(0)
    rule = FSPOClip(band=band, z=1.0, calibration={"alpha": 0.02})
    for _ in range(100):
        S, L = batch(gen, 512, gamma=0.8)
        rule.observe(S, L, torch.zeros(0), torch.zeros(0))
    S, L = batch(gen, 60000, gamma=0.8)
    c = float((S / L.sqrt()).std())  # the paper's sigma_hat from all (S - mu_L) / sqrt(L), z = 1
    paper = FSPOClip(c_upper=c, c_lower=c, c_dual=c)
    ranges = [(10, 30), (100, 300), (1000, 2001)]
    ours = [float(out_of_band(rule, S, L)[(L >= a) & (L < b)].float().mean()) for a, b in ranges]
    sqrt = [float(out_of_band(paper, S, L)[(L >= a) & (L < b)].float().mean()) for a, b in ranges]
    print(band, "calibrated", [round(x, 3) for x in ours], "sqrt law", [round(x, 3) for x in sqrt])
    assert all(abs(x - TARGET) < 0.02 for x in ours), ours
    assert max(sqrt) - min(sqrt) > 0.3  # the paper's band drifts with L on this law
    assert abs(rule.extra_metrics()["clip/band_gamma"] - 0.8) < 0.05 if band == "power" else True


def test_calibrated_state_is_checkpointed_and_used():
    gen = torch.Generator().manual_seed(1)
    a = FSPOClip(band="per_bin")
    for _ in range(10):
        S, L = batch(gen, 256, gamma=0.9)
        a.observe(S, L, torch.zeros(0), torch.zeros(0))
    b = FSPOClip(band="per_bin")
    L = torch.tensor([0.0, 12.0, 150.0, 1500.0, 32768.0])
    assert not torch.equal(a.bounds(L)[1], b.bounds(L)[1])
    b.load_state_dict(a.state_dict())
    for x, y in zip(a.bounds(L), b.bounds(L)):
        torch.testing.assert_close(x, y)
    lo, hi, du = a.bounds(L)
    assert lo[0] == 0 and hi[0] == 0 and torch.isfinite(torch.stack([lo, hi, du])).all()
    assert (du >= hi).all()


def test_warm_start_is_the_sqrt_law_with_sigma0():
    rule = FSPOClip(band="power", z=1.5, sigma0=0.02)
    L = torch.tensor([4.0, 100.0])
    _, hi, du = rule.bounds(L)
    torch.testing.assert_close(hi, 1.5 * 0.02 * L.sqrt())
    torch.testing.assert_close(du, torch.maximum(0.03 * L.sqrt(), hi))


def test_loss_uses_the_calibrated_band():
    # warm start, z = 1, sigma0 = 0.05: L = 4 band +-0.1. S = 0.08 in band, S = 0.15 above (A > 0 binds)
    rule = FSPOClip(band="power", sigma0=0.05, c_dual=0.05)
    lp = torch.tensor([[0.02] * 4, [0.0375] * 4], requires_grad=True)
    res = rule(lp, torch.zeros(2, 4), torch.ones(2), torch.ones(2, 4))
    assert res.in_band[:, 0].tolist() == [True, False] and res.clip_upper[:, 0].tolist() == [False, True]
    torch.testing.assert_close(res.token_loss[1], torch.full((4,), -math.exp(0.1)))


@pytest.mark.parametrize("name", ["fspo_power", "fspo_per_bin"])
def test_yamls_instantiate(name):
    rule = instantiate(clip_config(name))
    assert rule.band == name.split("_", 1)[1] and rule.calibrator is not None
    assert any(k.startswith("clip/band_") for k in rule.extra_metrics())


def test_bad_calibration_setting_names_it():
    with pytest.raises(ValueError, match="alpha"):
        FSPOClip(band="power", calibration={"alpha": 2.0})
    with pytest.raises(ValueError, match="band"):
        FSPOClip(band="gaussian")
