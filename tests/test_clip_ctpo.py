"""CTPO (fspo/clipping/ctpo.py): hand-computed values and gradients with padding, the geomean variant, the
cap, both acceptance readings and the diagnostics they feed, the closed-form curve, the registry names,
and parity with the CTPO repository's ``cum-token-cumprod-la`` / ``cum-token-geomean-la`` re-derived
here independently, element by element in float64 Python (no code of the repository is used).

Gradients are of the ``token-sum`` aggregation (each entry is d token_loss / d logp itself) unless a
test says otherwise; old log-probs are 0, so logp_t = d_t.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_clip_cispo_sapo_gmpo_luspo import grad, tokens
from test_clip_cispo_sapo_gmpo_luspo import test_bf16_inputs_math_in_float32 as check_bf16
from test_clip_cispo_sapo_gmpo_luspo import test_extreme_log_ratios_and_long_sequences_stay_finite as check_extreme
from test_clip_cispo_sapo_gmpo_luspo import test_on_policy_is_minus_advantage_and_never_clipped as check_on_policy

from fspo.clipping import theory
from fspo.clipping.ctpo import CTPOClip
from fspo.clipping.registry import POLICY_LOSSES, get_policy_loss_fn
from fspo.diagnostics.bins import LengthBins
from fspo.diagnostics.collection import FairnessMetrics
from fspo.losses import AGG_MODES, aggregate

WIDE = dict(la_clip_low=0.1, la_clip_high=0.2, la_clip_c=0.3, la_power=0.5)


def hand_rows():
    # band at t = 1..4 (sqrt t = 1, 1.41421356, 1.73205081, 2): hi 0.2, 0.28284, 0.34641, 0.4;
    # lo -0.1, -0.14142, -0.17321, -0.2; dual 0.3, 0.42426, 0.51962, 0.6 (all log space)
    return tokens([([0.1, 0.15, 0.2, -0.3], 1.0),  # C = 0.1, 0.25, 0.45, 0.15: only t = 3 above hi (upper)
                   ([-0.2, 0.1, 0.5], -1.0),       # C = -0.2 (< lo: lower), -0.1 (in), 0.4 (> hi, < dual: no clip)
                   ([0.35, 0.0], -2.0),            # C = 0.35 (> dual 0.3: dual), 0.35 (> hi, < dual 0.424: no clip)
                   ([], 1.0)])                     # L = 0


def test_hand_computed_values_gradients_and_masks():
    lp, old, a, m = hand_rows()
    res = CTPOClip(**WIDE)(lp, old, a, m)
    e = math.exp
    want = torch.tensor([
        [-e(0.1), -e(0.25), -e(0.2 * math.sqrt(3)), -e(0.15)],  # t = 3 clipped to exp(hi_3) = 1.41398
        [e(-0.1), e(-0.1), e(0.4), 0.0],                        # A < 0: max(e^-0.2, e^-0.1); then r; then r
        [2 * e(0.3), 2 * e(0.35), 0.0, 0.0],                    # dual: min(2 e^0.35, 2 e^0.3); then 2 r
        [0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(res.token_loss, want)
    # d loss_t / d logp_t = -A_t r_t, r_t = exp(C_t), where nothing binds; 0 where a clip binds
    torch.testing.assert_close(grad(res, lp, m), torch.tensor([
        [-e(0.1), -e(0.25), 0.0, -e(0.15)],
        [0.0, e(-0.1), e(0.4), 0.0],
        [0.0, 2 * e(0.35), 0.0, 0.0],
        [0.0, 0.0, 0.0, 0.0]]))
    # token-mean: the same per token over sum L = 9
    torch.testing.assert_close(grad(res, lp, m, "token-mean")[0, 0], torch.tensor(-e(0.1) / 9))
    assert res.clip_upper.int().tolist() == [[0, 0, 1, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    assert res.clip_lower.int().tolist() == [[0, 0, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    assert res.clip_dual.int().tolist() == [[0, 0, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]]
    assert not res.clip_cap.any()
    # acceptance "prefix": lo_t <= C_t <= hi_t per token, any sign of A
    assert res.in_band.int().tolist() == [[1, 1, 0, 1], [0, 1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    torch.testing.assert_close(res.seq_log_ratio, torch.tensor([0.15, 0.4, 0.35, 0.0]))
    # acceptance "last": the last prefix's decision on every token (C_L = 0.15 in [-0.2, 0.4]; 0.4 > 0.346;
    # 0.35 > 0.283); loss and masks unchanged
    last = CTPOClip(**WIDE, acceptance="last")(lp, old, a, m)
    assert last.in_band.int().tolist() == [[1, 1, 1, 1], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    torch.testing.assert_close(last.token_loss, res.token_loss)


def test_without_dual_clip_row_two_keeps_its_gradient():
    lp, old, a, m = hand_rows()
    res = CTPOClip(**{**WIDE, "la_clip_c": None})(lp, old, a, m)
    assert res.token_loss[2, 0].item() == pytest.approx(2 * math.exp(0.35), rel=1e-6)
    assert grad(res, lp, m)[2, 0].item() == pytest.approx(2 * math.exp(0.35), rel=1e-6)
    assert not res.clip_dual.any()


def test_geomean_with_shrinking_band():
    # C_t = mean of d_1..d_t; p = -0.5: hi_t = 0.2 / sqrt t = 0.2, 0.141421, 0.115470; lo_t = -hi_t / 2
    lp, old, a, m = tokens([([0.3, 0.0, -0.15], 1.0)])  # C = 0.3 (upper), 0.15 (> 0.1414: upper), 0.05 (in)
    res = CTPOClip(**{**WIDE, "la_power": -0.5}, ratio_mode="geomean")(lp, old, a, m)
    e = math.exp
    torch.testing.assert_close(res.token_loss, torch.tensor([[-e(0.2), -e(0.2 / math.sqrt(2)), -e(0.05)]]))
    torch.testing.assert_close(grad(res, lp, m), torch.tensor([[0.0, 0.0, -e(0.05)]]))
    assert res.clip_upper.int().tolist() == [[1, 1, 0]] and res.in_band.int().tolist() == [[0, 0, 1]]


def test_uniform_band_with_power_zero():
    # p = 0: band [-0.1, 0.2] at every t; C = 0.15, 0.3 (upper)
    lp, old, a, m = tokens([([0.15, 0.15], 1.0)])
    res = CTPOClip(**{**WIDE, "la_power": 0.0})(lp, old, a, m)
    torch.testing.assert_close(res.token_loss, torch.tensor([[-math.exp(0.15), -math.exp(0.2)]]))
    assert res.clip_upper.int().tolist() == [[0, 1]]


def test_cap_at_ten_and_per_token_clamp_at_twenty():
    # no dual clip, huge band: A < 0, C = 11 > 10: log r capped at 10, value e^10, no gradient, clip_cap
    lp, old, a, m = tokens([([11.0], -1.0), ([25.0, -1.0], 1.0)])
    res = CTPOClip(la_clip_low=50.0, la_clip_high=50.0, la_clip_c=None)(lp, old, a, m)
    assert res.token_loss[0, 0].item() == pytest.approx(math.exp(10.0), rel=1e-6)
    g = grad(res, lp, m)
    assert g[0, 0].item() == 0.0 and res.clip_cap[0, 0] and not res.clipped[0, 0]
    # row 1: d_1 = 25 is clamped to 20 inside the prefix sum (C = 20, 19: both capped at 10)
    assert res.clip_cap[1].all() and g[1].abs().sum() == 0
    assert res.seq_log_ratio[1].item() == pytest.approx(24.0)  # S itself is unclamped (the ClipResult contract)


def test_padding_holding_minus_inf_keeps_gradients_finite():
    lp, old, a, m = hand_rows()
    lp = lp.detach().masked_fill(m == 0, float("-inf")).requires_grad_(True)
    res = CTPOClip(**WIDE)(lp, old, a, m)
    g = grad(res, lp, m)
    assert torch.isfinite(res.token_loss).all() and torch.isfinite(g).all() and g[m == 0].abs().sum() == 0


@pytest.mark.parametrize("check", [check_on_policy, check_extreme, check_bf16])
@pytest.mark.parametrize("rule", [CTPOClip(), CTPOClip(ratio_mode="geomean", la_power=-0.5),
                                  CTPOClip(acceptance="last")], ids=["cumprod", "geomean", "last"])
def test_shared_rule_checks(check, rule):
    check(rule)


def test_feeds_the_length_fairness_diagnostics():
    lp, old, a, m = hand_rows()
    fm = FairnessMetrics(LengthBins(edges=[0, 3, 8]))
    fm.update_clip(CTPOClip(**WIDE)(lp.detach(), old, a, m), None, m, a)
    out = fm.compute()
    # per-sequence out-of-band fractions 1/4, 2/3, 1 (the L = 0 row is in no bin); tokens 1 + 2 + 2 of 9
    assert out["band/out_frac"] == pytest.approx((1 / 4 + 2 / 3 + 1) / 3)
    assert out["band/tok_out_frac"] == pytest.approx(5 / 9)
    assert out["band/out_frac/len_00000_00003"] == pytest.approx(1.0)  # row 2 (L = 2)
    assert out["band/out_frac/len_00003_00008"] == pytest.approx((1 / 4 + 2 / 3) / 2)
    # binding clips: one token in each of rows 0, 1, 2
    assert out["clip/tok_frac"] == pytest.approx(3 / 9)
    assert out["clip/seq_frac"] == pytest.approx((1 / 4 + 1 / 3 + 1 / 2) / 3)
    assert "fairness/lre" in out and "fairness/binding_lre" in out


def _phi(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def test_theory_curve():
    L = np.array([0.0, 1.0, 2.0, 500.0])
    sigma = 0.03
    # cumprod with p = 1/2 (and geomean with p = -1/2): flat, FSPO's c(L) with c_hi = high, c_lo = low
    flat = theory.c_fspo(L, sigma, 0.05, 0.025)
    for rule in (CTPOClip(), CTPOClip(ratio_mode="geomean", la_power=-0.5), CTPOClip(acceptance="last")):
        np.testing.assert_allclose(rule.theory_clip_fraction(L, sigma), np.where(L > 0, flat, 0.0), rtol=1e-12)
    assert flat[1] == pytest.approx(_phi(-0.05 / 0.03) + _phi(-0.025 / 0.03))
    # p = 0 (uniform band), cumprod: o(t) = Phi(-0.05 / (sigma sqrt t)) + Phi(-0.025 / (sigma sqrt t))
    o = [_phi(-0.05 / (sigma * math.sqrt(t))) + _phi(-0.025 / (sigma * math.sqrt(t))) for t in (1, 2)]
    np.testing.assert_allclose(CTPOClip(la_power=0.0).theory_clip_fraction(L[:3], sigma),
                               [0.0, o[0], (o[0] + o[1]) / 2])
    np.testing.assert_allclose(CTPOClip(la_power=0.0, acceptance="last").theory_clip_fraction(L[:3], sigma),
                               [0.0, o[0], o[1]])


@pytest.mark.parametrize("kw, name", [(dict(la_clip_low=0.0), "la_clip_low"), (dict(la_clip_high=-1.0), "la_clip_high"),
                                      (dict(la_clip_c=0.0), "la_clip_c"), (dict(la_power=float("nan")), "la_power"),
                                      (dict(ratio_mode="mean"), "ratio_mode"), (dict(acceptance="all"), "acceptance")])
def test_bad_settings(kw, name):
    with pytest.raises(ValueError, match=name):
        CTPOClip(**kw)


# ---- parity with the CTPO repository, re-derived element by element --------------------------------
def reference(d, logp_mask, adv, low, high, c, power, mode):
    """float64 loss matrix and d loss / d logp of CTPO's cum-token-*-la, one token at a time, from its
    equations: per-token clamp +-20, prefix sum (or mean), cap 10, band +-(low, high) t^p, dual c t^p."""
    B, T = len(d), len(d[0])
    loss, gradient = np.zeros((B, T)), np.zeros((B, T))
    for i in range(B):
        acc, t = 0.0, 0
        for j in range(T):
            if not logp_mask[i][j]:
                continue
            t += 1
            acc += min(max(d[i][j], -20.0), 20.0)
            stat = acc if mode == "cumprod" else acc / t
            x = min(stat, 10.0)
            s = t ** power
            lo, hi, du = -low * s, high * s, c * s
            A = adv[i][j]
            l1, l2 = -A * math.exp(x), -A * math.exp(min(max(x, lo), hi))
            value, live = (l1, True) if l1 >= l2 else (l2, False)  # l1 == l2: unclipped (same value)
            if A < 0 and value > -A * math.exp(du):
                value, live = -A * math.exp(du), False
            loss[i, j] = value
            gradient[i, j] = -A * math.exp(x) if live and stat < 10.0 else 0.0
    return loss, gradient


def parity_batch(seed):
    g = torch.Generator().manual_seed(seed)
    B, T = 6, 40
    d = torch.randn(B, T, generator=g, dtype=torch.float64) * 0.08
    d[1, 3], d[2, 7], d[4, 0] = 25.0, -30.0, 9.0  # beyond the +-20 clamp; above the cap 10 for a while
    m = torch.ones(B, T)
    m[3, 17:] = 0
    m[5] = 0
    m[0, 30:] = 0
    adv = (torch.tensor([1.0, -1.0, 0.7, -0.4, -2.0, 1.0])[:, None] + 0.3 * torch.randn(B, T, generator=g)) * m
    adv[2] = 0.0  # a zero-advantage row
    return d, m, adv


@pytest.mark.parametrize("mode, power", [("cumprod", 0.5), ("cumprod", 0.0), ("geomean", -0.5)])
@pytest.mark.parametrize("seed", [0, 1])
def test_parity_with_ctpo_repository(mode, power, seed):
    d, m, adv = parity_batch(seed)
    low, high, c = 0.025, 0.05, 0.05
    ref_loss, ref_grad = reference(d.tolist(), m.bool().tolist(), adv.tolist(), low, high, c, power, mode)
    lp = d.float().requires_grad_(True)
    old = torch.zeros_like(lp)
    res = CTPOClip(low, high, c, power, ratio_mode=mode)(lp, old, adv, m)
    torch.testing.assert_close(res.token_loss.double(), torch.from_numpy(ref_loss), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad(res, lp, m).double(), torch.from_numpy(ref_grad), rtol=1e-5, atol=1e-6)
    assert res.clipped.any() and (~res.clipped & m.bool()).any()  # both branches exercised
    # the registry names, with CTPO's config keys, aggregate as verl's agg_loss does
    name = {"cumprod": "cum-token-cumprod-la", "geomean": "cum-token-geomean-la"}[mode]
    cfg = {"la_clip_low": low, "la_clip_high": high, "la_clip_c": c, "clip_ratio_la_power": power}
    for agg in AGG_MODES:
        loss, metrics = get_policy_loss_fn(name)(old, lp, adv, m, agg, cfg)
        want = aggregate(torch.from_numpy(ref_loss).float(), m, agg).loss
        torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    mf = m.double()
    ref_kl = float((-(d.clamp(-20, 20)) * mf).sum() / mf.sum())
    assert metrics["actor/ppo_kl"] == pytest.approx(ref_kl, rel=1e-5)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(float(((res.clip_upper | res.clip_lower) * m).sum() / m.sum()))
    assert metrics["actor/pg_clipfrac_lower"] == pytest.approx(float((res.clip_dual * m).sum() / m.sum()))


def test_registry_names():
    assert {"ctpo", "cum-token-cumprod-la", "cum-token-geomean-la"} <= set(POLICY_LOSSES)
    assert get_policy_loss_fn("ctpo") is get_policy_loss_fn("cum-token-cumprod-la")
    lp, old, a, m = hand_rows()
    # unset config: the repository's defaults (0.025, 0.05, 0.05) and ctpo.sh's power 0.5
    loss, _ = get_policy_loss_fn("ctpo")(old, lp, a, m, "token-sum", None)
    want = aggregate(CTPOClip()(lp, old, a, m).token_loss, m, "token-sum").loss
    torch.testing.assert_close(loss, want)


@pytest.mark.slow
def test_trains_two_steps_and_logs_its_length_diagnostics(compose_cfg, mlflow_uri):
    """+method=ctpo through `fspo.train.train` (real Lightning Trainer, HF engine, MLflow SQLite store): the
    run finishes, the rule is CTPOClip, and the acceptance and binding-clip diagnostics are logged per step."""
    import mlflow

    from conftest import SMALL
    from fspo.train import train

    cfg = compose_cfg(["+method=ctpo", "+model=tiny", *SMALL, "seed=7", "logger.experiment_name=test_train_ctpo"])
    train(cfg)
    client = mlflow.MlflowClient(tracking_uri=mlflow_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("test_train_ctpo").experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["clip/target"] == "fspo.clipping.ctpo.CTPOClip"
    for key in ("clip/tok_frac", "clip/seq_frac", "band/out_frac", "fairness/lre", "train/loss"):
        assert sorted(m.step for m in client.get_metric_history(run.info.run_id, key)) == [0, 1], key
    assert any(k.startswith("band/out_frac.len_") for k in run.data.metrics)
    assert 0.0 <= run.data.metrics["band/out_frac"] <= 1.0
