"""VESPO, DPPO and CPPO clip rules: hand-computed values and per-token gradients, masks, settings, the
registry names and the length diagnostics they feed.

Gradients are of the ``token-sum`` aggregation (k_i = 1), so each entry is d token_loss / d logp itself.
tests/test_verl_parity.py checks DPPO against verl 0.9.1 itself (verl has no VESPO or CPPO).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_clip_baselines import test_bf16_inputs_math_in_float32 as check_bf16
from test_clip_cispo_sapo_gmpo_luspo import test_extreme_log_ratios_and_long_sequences_stay_finite as check_extremes
from test_clip_cispo_sapo_gmpo_luspo import test_on_policy_is_minus_advantage_and_never_clipped as check_on_policy

from fspo.clipping import theory
from fspo.clipping.cppo import CPPOClip
from fspo.clipping.dppo import DPPOClip
from fspo.clipping.registry import POLICY_LOSSES, get_policy_loss_fn
from fspo.clipping.vespo import VESPOClip, vespo_band
from fspo.diagnostics.bins import LengthBins
from fspo.diagnostics.collection import FairnessMetrics
from fspo.losses import aggregate

RULES = [VESPOClip(), VESPOClip(length_scale="sqrt", ref_length=4.0), DPPOClip(), DPPOClip("kl", 0.05, 0.05),
         CPPOClip()]
IDS = ["vespo", "vespo_sqrt", "dppo_tv", "dppo_kl", "cppo"]


def rows_to(rows, T=None):
    """rows of (new probs, old probs, A) -> (log p requiring grad, log q, A [B], mask)."""
    T = T or max(len(p) for p, _, _ in rows)
    lp, lq, m = torch.zeros(len(rows), T), torch.zeros(len(rows), T), torch.zeros(len(rows), T)
    for i, (p, q, _) in enumerate(rows):
        lp[i, :len(p)] = torch.log(torch.tensor(p, dtype=torch.float64)).float()
        lq[i, :len(q)] = torch.log(torch.tensor(q, dtype=torch.float64)).float()
        m[i, :len(p)] = 1
    return lp.requires_grad_(True), lq, torch.tensor([a for _, _, a in rows]), m


def grad(res, lp, m):
    (g,) = torch.autograd.grad(aggregate(res.token_loss, m, "token-sum").loss, lp, retain_graph=True)
    return g


def col(mask):
    return mask[:, 0].int().tolist()


# ---- VESPO --------------------------------------------------------------------------------------
def phi(s, k, lam):
    """w^k e^{lam (1 - w)}, w = e^s (the equation, for the expectations below)."""
    return math.exp(k * s + lam * (1.0 - math.exp(s)))


def test_vespo_hand_computed():
    # old log-probs 0, so logp_t = d_t; S = sum d (no 1 / L); (k, lam) = (2, 3) for A >= 0, (3, 2) for A < 0
    d = [[0.1, 0.2, 0.0], [-0.5, 0, 0], [0.0, 0.0, 0.0], [2.0, 0, 0], [1.0, 0, 0]]
    lens = [2, 1, 3, 1, 1]
    a = torch.tensor([1.0, -1.0, 0.5, 1.0, 0.0])
    lp = torch.tensor(d).requires_grad_(True)
    m = (torch.arange(3) < torch.tensor(lens)[:, None]).float()
    res = VESPOClip()(lp, torch.zeros(5, 3), a, m)
    p1 = phi(0.3, 2, 3)     # e^{0.6 + 3 (1 - e^0.3)} = e^{-0.44958} = 0.63790: in band (>= 1/2)
    p2 = phi(-0.5, 3, 2)    # e^{-1.5 + 2 (1 - e^-0.5)} = e^{-0.71306} = 0.49014 < 1/2: clipped, below
    p4 = phi(2.0, 2, 3)     # e^{4 + 3 (1 - e^2)} = e^{-15.167} = 2.6e-7: clipped, above
    assert p1 == pytest.approx(0.637898, abs=1e-6) and p2 == pytest.approx(0.490141, abs=1e-6)
    want_g = torch.tensor([[-p1, -p1, 0], [p2, 0, 0], [-0.5, -0.5, -0.5], [-p4, 0, 0], [0, 0, 0]])
    torch.testing.assert_close(grad(res, lp, m), want_g)
    torch.testing.assert_close(res.token_loss, want_g)  # surrogate value: -phi A on every token
    assert col(res.clip_upper) == [0, 0, 0, 1, 0] and col(res.clip_lower) == [0, 1, 0, 0, 0]
    # A = 0 (row 4): out of band, phi(e^1) with k=2, lam=3 = e^{2 + 3(1 - e)} = 0.042 < 1/2, but not clipped
    assert phi(1.0, 2, 3) == pytest.approx(math.exp(2 - 3 * (math.e - 1)))
    assert col(res.in_band) == [1, 0, 1, 0, 0] and not res.clip_dual.any()
    verl = VESPOClip(value="verl")(lp, torch.zeros(5, 3), a, m)  # -phi A logp: value differs, gradient not
    assert float(verl.token_loss[0, 1].detach()) == pytest.approx(-p1 * 0.2, rel=1e-6)
    torch.testing.assert_close(grad(verl, lp, m), want_g)


def test_vespo_sqrt_variant_reads_s_over_sqrt_l():
    # length_scale=sqrt, ref_length 4: the kernel reads S sqrt(4 / L). L = 16, S = 0.8 -> x = 0.4
    lp = torch.full((1, 16), 0.05).requires_grad_(True)
    res = VESPOClip(length_scale="sqrt", ref_length=4.0)(lp, torch.zeros(1, 16), torch.tensor([1.0]), torch.ones(1, 16))
    torch.testing.assert_close(grad(res, lp, torch.ones(1, 16)), torch.full((1, 16), -phi(0.4, 2, 3)))
    # at L = ref_length it is VESPO
    lp4 = torch.full((1, 4), 0.1).requires_grad_(True)
    a, b = (VESPOClip(length_scale=s, ref_length=4.0)(lp4, torch.zeros(1, 4), torch.tensor([1.0]), torch.ones(1, 4))
            for s in ("sqrt", "none"))
    torch.testing.assert_close(a.token_loss, b.token_loss)


def test_vespo_band_and_theory():
    lo, hi = vespo_band(2.0, 3.0)
    for x in (lo, hi):  # the edges are where phi = 1/2
        assert phi(x, 2, 3) == pytest.approx(0.5, rel=1e-10)
    assert lo < 0 < hi and vespo_band(0.0, 3.0)[0] == -math.inf and vespo_band(2.0, 0.0)[1] == math.inf
    L = np.array([10.0, 100.0, 1000.0])
    c = VESPOClip().theory_clip_fraction(L, 0.03)
    lo2, hi2 = vespo_band(3.0, 2.0)
    want = 0.5 * (theory.c_rloo(L, 0.03, math.expm1(hi), -math.expm1(lo))
                  + theory.c_rloo(L, 0.03, math.expm1(hi2), -math.expm1(lo2)))
    np.testing.assert_allclose(c, want)
    assert c[0] < c[1] < c[2]  # a fixed interval of S: grows with L, as RLOO's
    flat = VESPOClip(length_scale="sqrt").theory_clip_fraction(L, 0.03)
    np.testing.assert_allclose(flat, flat[0])  # the sqrt variant: flat in L


# ---- DPPO ---------------------------------------------------------------------------------------
def test_dppo_tv_hand_computed():
    # q = 0.5 unless stated; TV test on p - q with thresholds 0.2 / 0.2; gradient -A min(r, C) on valid tokens
    rows = [([0.8], [0.5], 1.0),    # p - q = 0.3 > 0.2, A > 0: masked (upper), gradient 0
            ([0.6], [0.5], 1.0),    # 0.1 <= 0.2: r = 1.2, gradient -1.2
            ([0.2], [0.5], -1.0),   # -0.3 < -0.2, A < 0: masked (lower)
            ([0.8], [0.5], -1.0),   # moved against A: valid, r = 1.6, gradient +1.6
            ([0.1], [0.5], 1.0),    # moved against A: valid, r = 0.2, gradient -0.2 (out of band: -0.4)
            ([0.05], [0.01], 1.0)]  # p - q = 0.04: valid, r = 5 truncated to C = 3: gradient -3
    lp, lq, a, m = rows_to(rows)
    res = DPPOClip("tv", 0.2, 0.2, clip_ratio_c=3.0)(lp, lq, a, m)
    torch.testing.assert_close(grad(res, lp, m)[:, 0], torch.tensor([0.0, -1.2, 0.0, 1.6, -0.2, -3.0]))
    torch.testing.assert_close(res.token_loss[:, 0], torch.tensor([0.0, -1.2, 0.0, 1.6, -0.2, -3.0]))
    assert col(res.clip_upper) == [1, 0, 0, 0, 0, 0] and col(res.clip_lower) == [0, 0, 1, 0, 0, 0]
    assert col(res.in_band) == [0, 1, 0, 0, 0, 1]  # any sign: -0.2 <= p - q <= 0.2
    verl = DPPOClip("tv", 0.2, 0.2, clip_ratio_c=3.0, value="verl")(lp, lq, a, m)
    assert float(verl.token_loss[1, 0]) == pytest.approx(-1.2 * math.log(0.6), rel=1e-5)


def test_dppo_kl_hand_computed():
    # binary KL(q || p) at q = 0.5, p = 0.6: 0.5 ln(0.5/0.6) + 0.5 ln(0.5/0.4) = 0.0204110
    kl = 0.5 * math.log(0.5 / 0.6) + 0.5 * math.log(0.5 / 0.4)
    assert kl == pytest.approx(0.0204110, abs=1e-7)
    lp, lq, a, m = rows_to([([0.6], [0.5], 1.0), ([0.6], [0.5], -1.0)])
    tight = DPPOClip("kl", 0.02, 0.02)(lp, lq, a, m)   # 0.0204 > 0.02: masked for A > 0; A < 0 moved against
    loose = DPPOClip("kl", 0.03, 0.03)(lp, lq, a, m)
    torch.testing.assert_close(grad(tight, lp, m)[:, 0], torch.tensor([0.0, 1.2]))
    torch.testing.assert_close(grad(loose, lp, m)[:, 0], torch.tensor([-1.2, 1.2]))


# ---- CPPO ---------------------------------------------------------------------------------------
def test_cppo_hand_computed():
    # L = 3, q = 0.5, A = +1, delta 0.2, w_min 0.8: w = [1, 0.9, 0.8], thresholds delta / w = [0.2, 0.2222, 0.25]
    rows = [([0.6, 0.71, 0.74], [0.5] * 3, 1.0),  # D = [0.1, 0.21, 0.24]: all within delta / w_t (DPPO masks t=1, 2);
            #   B = [0.1, (0.1 + 0.9*0.21)/2 = 0.1445, (0.289 + 0.8*0.24)/3 = 0.16033] <= 0.2: all valid
            ([0.1, 0.1, 0.65], [0.5] * 3, 1.0)]  # |D| = [0.4, 0.4, 0.15]; t = 0, 1 moved against A: kept;
    #   t = 2: 0.15 <= 0.25 but B = (0.4 + 0.36 + 0.8*0.15)/3 = 0.29333 > 0.2 and it moved with A: masked
    lp, lq, a, m = rows_to(rows)
    rule = CPPOClip("tv", 0.2, 0.2, w_min=0.8)
    p = rule_prepared(rule, lp, lq, a, m)
    torch.testing.assert_close(rule.weights(p)[0], torch.tensor([1.0, 0.9, 0.8]))
    torch.testing.assert_close(rule.prefix_budget(p, torch.exp(lp.detach()) - 0.5)[1],
                               torch.tensor([0.4, 0.38, 0.293333]), atol=1e-5, rtol=0)
    res = rule(lp, lq, a, m)
    want = torch.tensor([[-1.2, -1.42, -1.48], [-0.2, -0.2, 0.0]])
    torch.testing.assert_close(grad(res, lp, m), want)
    assert res.clip_upper.int().tolist() == [[0, 0, 0], [0, 0, 1]] and not res.clip_lower.any()
    dppo = DPPOClip("tv", 0.2, 0.2)(lp, lq, a, m)  # the uniform threshold masks row 0's t = 1, 2 instead
    assert dppo.clip_upper.int().tolist() == [[0, 1, 1], [0, 0, 0]]
    off = CPPOClip("tv", 0.2, 0.2, w_min=1.0, budget="none")(lp, lq, a, m)
    torch.testing.assert_close(off.token_loss, dppo.token_loss)


def rule_prepared(rule, lp, lq, a, m):
    from fspo.clipping._common import prepare
    return prepare("test", lp, lq, a, m)


# ---- all ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("rule", RULES, ids=IDS)
def test_on_policy_is_minus_advantage_and_never_clipped(rule):
    check_on_policy(rule)


@pytest.mark.parametrize("rule", RULES, ids=IDS)
def test_extreme_log_ratios_and_long_sequences_stay_finite(rule):
    check_extremes(rule)


@pytest.mark.parametrize("rule", RULES, ids=IDS)
def test_bf16_inputs_math_in_float32(rule):
    check_bf16(rule)


@pytest.mark.parametrize("rule", RULES, ids=IDS)
def test_feeds_the_length_fairness_diagnostics(rule):
    """band/*, clip/* and fairness/* per length bin, as for every rule."""
    g = torch.Generator().manual_seed(3)
    lq = -torch.rand(8, 6, generator=g) * 2
    lp = (lq + torch.randn(8, 6, generator=g)).clamp(max=-1e-3)
    m = (torch.arange(6) < torch.tensor([1, 2, 3, 4, 5, 6, 6, 2])[:, None]).float()
    a = torch.tensor([1.0, -1.0, 2.0, -2.0, 1.0, -1.0, 0.5, -0.5])
    fm = FairnessMetrics(LengthBins(edges=[0, 2, 8]))
    fm.update_clip(rule(lp, lq, a, m), None, m, a)
    out = fm.compute()
    assert {"band/out_frac", "clip/seq_frac", "clip/tok_frac", "fairness/lre"} <= set(out)
    assert any(k.startswith("clip/seq_frac/len_") for k in out)
    assert 0 < out["band/out_frac"] <= 1 and all(math.isfinite(v) for v in out.values())


@pytest.mark.parametrize("cls, kw, name", [
    (VESPOClip, dict(k_pos=-1.0), "k_pos"), (VESPOClip, dict(lambda_neg=float("nan")), "lambda_neg"),
    (VESPOClip, dict(length_scale="log"), "length_scale"), (VESPOClip, dict(ref_length=0), "ref_length"),
    (DPPOClip, dict(divergence="js"), "divergence"), (DPPOClip, dict(clip_ratio_high=-0.1), "clip_ratio_high"),
    (DPPOClip, dict(clip_ratio_c=0.0), "clip_ratio_c"), (CPPOClip, dict(w_min=1.5), "w_min"),
    (CPPOClip, dict(w_min=0.0), "w_min"), (CPPOClip, dict(budget="sum"), "budget")])
def test_bad_settings(cls, kw, name):
    with pytest.raises(ValueError, match=name):
        cls(**kw)


def test_registry_names():
    assert {"vespo", "dppo_tv", "dppo_kl", "cppo"} <= set(POLICY_LOSSES)
    lp, lq, a, m = rows_to([([0.6, 0.71, 0.74], [0.5] * 3, 1.0), ([0.1, 0.1, 0.65], [0.5] * 3, -1.0)])
    for name in ("vespo", "dppo_tv", "dppo_kl", "cppo"):
        loss, metrics = get_policy_loss_fn(name)(lq, lp, a[:, None] * m, m, "token-mean", None)
        assert torch.isfinite(loss) and set(metrics) == {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"}
    # vespo reads the recipe's sub-config (policy_loss.vespo) and plain keys alike
    cfg = {"policy_loss": {"vespo": {"k_pos": 0.0, "lambda_pos": 0.0}}}  # lambda floored at 1e-4 (TRL's, the recipe's)
    loss, _ = get_policy_loss_fn("vespo")(lq, lp, torch.ones(2, 3), m, "token-sum", cfg)
    w = torch.exp((lp.detach() - lq).sum(-1) * 1.0)  # k = 0: phi = e^{1e-4 (1 - w)}, -A phi logp summed
    want = -(torch.exp(1e-4 * (1 - w))[:, None] * lp.detach() * m).sum()
    assert float(loss) == pytest.approx(float(want), rel=1e-6)


@pytest.mark.parametrize("arm, L_med, c", [("vespo_matched", 72, 0.030), ("vespo_law", 114, 0.0015)])
def test_vespo_arms_match_fspo_at_the_median_length(arm, L_med, c):
    """The arms' half-weight edges sit at +-c sqrt(L_med), FSPO's matched band (sweeps/arm/fspo_matched.yaml for the
    length-fairness sweep, sweeps/arm/fspo_law.yaml for the length-law sweep)."""
    from omegaconf import OmegaConf

    from conftest import REPO

    clip = OmegaConf.load(REPO / "sweeps" / "arm" / f"{arm}.yaml").clip
    for k, lam in ((clip.k_pos, clip.lambda_pos), (clip.k_neg, clip.lambda_neg)):
        lo, hi = vespo_band(k, lam)
        assert hi == pytest.approx(c * math.sqrt(L_med), rel=2e-3) and -lo == pytest.approx(hi, rel=2e-3)
