"""CISPO, SAPO, GMPO and LUSPO clip rules: hand-computed values and gradients, masks, numerics,
settings, the registry names and the diagnostics they feed.

Gradients are taken of the ``token-sum`` aggregation (k_i = 1), so each entry is d token_loss / d logp
itself, unless a test says otherwise. old log-probs are 0, so logp_t = d_t. tests/test_verl_parity.py
checks CISPO, SAPO and GMPO against verl 0.9.1 itself.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_clip_baselines import test_bf16_inputs_math_in_float32 as check_bf16

from fspo.clipping import theory
from fspo.clipping.cispo import CISPOClip
from fspo.clipping.gmpo import GMPOClip
from fspo.clipping.gspo import GSPOClip
from fspo.clipping.luspo import LUSPOClip
from fspo.clipping.registry import POLICY_LOSSES, get_policy_loss_fn
from fspo.clipping.sapo import HALF_WEIGHT, SAPOClip
from fspo.diagnostics.bins import LengthBins
from fspo.diagnostics.collection import FairnessMetrics
from fspo.losses import aggregate

RULES = [CISPOClip(), SAPOClip(), GMPOClip(), LUSPOClip()]


def tokens(rows, T=None):
    """rows of (token log-ratios d_t, A) -> (log_prob requiring grad, old 0, A [B], mask)."""
    T = T or max(1, max(len(d) for d, _ in rows))
    lp, m = torch.zeros(len(rows), T), torch.zeros(len(rows), T)
    for i, (d, _) in enumerate(rows):
        lp[i, :len(d)] = torch.tensor(d, dtype=torch.float32)
        m[i, :len(d)] = 1
    return lp.requires_grad_(True), torch.zeros(len(rows), T), torch.tensor([a for _, a in rows]), m


def grad(res, lp, m, mode="token-sum"):
    (g,) = torch.autograd.grad(aggregate(res.token_loss, m, mode).loss, lp, retain_graph=True)
    return g


def col(mask):
    return mask[:, 0].int().tolist()


# ---- CISPO --------------------------------------------------------------------------------------
def test_cispo_hand_computed():
    # w = sg(clip(exp(d), 1 - 1.0, 1 + 0.28)): no floor, cap 1.28. Gradient -w A on every token.
    rows = [([0.1], 1.0),    # w = e^0.1 = 1.1051709180756477; surrogate -w A; verl -w A logp = -0.110517...
            ([0.5], 1.0),    # e^0.5 = 1.6487 > 1.28: w = 1.28 (upper), the gradient stays: -1.28
            ([-0.5], -1.0),  # w = e^-0.5 = 0.6065306597126334 (no floor): +0.60653
            ([0.5], -2.0),   # w = 1.28 (upper, A < 0 too): +2.56
            ([30.0], 1.0),   # clamp 20: w = 1.28, upper: -1.28
            ([1.0], 0.0),    # A = 0: loss and gradient 0, no mask (out of band)
            ([], 1.0)]       # L = 0
    lp, old, a, m = tokens(rows)
    w = torch.tensor([1.1051709180756477, 1.28, 0.6065306597126334, 1.28, 1.28, 1.28, 0.0])
    res = CISPOClip()(lp, old, a, m)
    torch.testing.assert_close(res.token_loss[:, 0], -w * a)
    torch.testing.assert_close(grad(res, lp, m)[:, 0], -w * a)
    verl = CISPOClip(value="verl")(lp, old, a, m)  # -w A logp: logp = 30 in row 4 (the clamp is on the weight)
    torch.testing.assert_close(verl.token_loss[:, 0], torch.tensor(
        [-0.11051709180756478, -0.64, -0.3032653298563167, 1.28, -38.4, 0.0, 0.0]))
    torch.testing.assert_close(grad(verl, lp, m), grad(res, lp, m))  # same gradient, other value
    assert col(res.clip_upper) == [0, 1, 0, 1, 1, 0, 0] and not res.clip_lower.any() and not res.clip_dual.any()
    assert col(res.in_band) == [1, 0, 1, 0, 0, 0, 0]
    # two-sided: floor 0.8 -> row 2's weight 0.8 (lower), gradient +0.8
    two = CISPOClip(clip_ratio_low=0.2)(lp, old, a, m)
    assert col(two.clip_lower) == [0, 0, 1, 0, 0, 0, 0]
    assert grad(two, lp, m)[2, 0].item() == pytest.approx(0.8)


# ---- SAPO ---------------------------------------------------------------------------------------
def test_sapo_hand_computed():
    # f(r) = (4 / tau) sigmoid(tau (r - 1)), tau 1 (A > 0) / 1.05 (A <= 0); gradient -A r w, w = 4 s (1 - s)
    rows = [([0.0], 1.0),           # r = 1: s = 0.5, f = 2; verl -2, surrogate -1; w = 1: grad -1
            ([math.log(2)], 1.0),   # r = 2: s = sigma(1) = 0.7310585786300049, f = 2.9242343145200196,
                                    # verl -2.92423, surrogate -1.92423; w = 0.7864477329659274,
                                    # grad -2 w = -1.5728954659318548
            ([math.log(3)], 1.0),   # r = 3: tau (r - 1) = 2 > 1.7627: upper; s = 0.8807970779778823,
                                    # f = 3.5231883119115293; w = 0.41997434161402647, grad -1.2599230248420794
            ([math.log(2)], -1.0),  # tau 1.05: s = sigma(1.05) = 0.740774899182154, f = 2.821999615932015,
                                    # surrogate +(f - 2/1.05 + 1) = 1.9172377111701104;
                                    # w = 0.7681097916952943, grad +2 w = +1.5362195833905885
            ([0.7], 0.0),           # A = 0: 0
            ([], 1.0)]
    lp, old, a, m = tokens(rows)
    res = SAPOClip()(lp, old, a, m)
    torch.testing.assert_close(res.token_loss[:, 0], torch.tensor(
        [-1.0, -1.9242343145200196, -2.5231883119115293, 1.9172377111701104, 0.0, 0.0]))
    want_grad = torch.tensor([-1.0, -1.5728954659318548, -1.2599230248420794, 1.5362195833905885, 0.0, 0.0])
    torch.testing.assert_close(grad(res, lp, m)[:, 0], want_grad)
    verl = SAPOClip(value="verl")(lp, old, a, m)
    torch.testing.assert_close(verl.token_loss[:, 0], torch.tensor(
        [-2.0, -2.9242343145200196, -3.5231883119115293, 2.821999615932015, 0.0, 0.0]))
    torch.testing.assert_close(grad(verl, lp, m)[:, 0], want_grad)
    assert col(res.clip_upper) == [0, 0, 1, 0, 0, 0] and not res.clip_lower.any()
    assert col(res.in_band) == [1, 1, 0, 1, 1, 0]  # A = 0 row: |1.05 (e^0.7 - 1)| = 1.06 <= 1.7627
    assert HALF_WEIGHT == pytest.approx(2 * math.log(1 + math.sqrt(2)))  # 4 s (1 - s) = 1/2 there


def test_sapo_sharp_gate_clips_below():
    # tau 4, r = 0.5: tau (r - 1) = -2 < -1.7627: lower; s = sigma(-2) = 0.11920292202211755,
    # surrogate -(f - 2/4 + 1) with f = s = 0.1192...: -0.6192029220221176;
    # w = 4 s (1 - s) = 0.419974341614026, grad -r w = -0.209987170807013
    lp, old, a, m = tokens([([math.log(0.5)], 1.0)])
    res = SAPOClip(tau_pos=4.0, tau_neg=4.0)(lp, old, a, m)
    assert res.clip_lower.all() and not res.clip_upper.any()
    assert res.token_loss.item() == pytest.approx(-0.6192029220221176, rel=1e-6)
    assert grad(res, lp, m).item() == pytest.approx(-0.209987170807013, rel=1e-6)


# ---- GMPO ---------------------------------------------------------------------------------------
def test_gmpo_hand_computed():
    # log-space band [-0.4, 0.4]; c_t = d_t capped at 0.4 (A > 0) / floored at -0.4 (A < 0); J_i = A_i e^{mean c}
    rows = [([0.2, 0.6], 1.0),         # c = [0.2, 0.4] (token 1 upper): G = 0.3, J = e^0.3 = 1.3498588075760032
            ([-0.6, 0.2, 0.1], -1.0),  # c = [-0.4, 0.2, 0.1] (token 0 lower): G = -1/30, J = -0.9672161004820059
            ([-0.6, 0.0], 1.0),        # A > 0 keeps d = -0.6 (unclipped, out of band): G = -0.3, J = 0.7408182206817179
            ([5.0, 5.0], 0.0),         # A = 0: sign 0, c = 0, J = 0
            ([30.0, 30.0], -1.0),      # A < 0 keeps d: G = 30 > 20, capped: loss e^20 = 485165195.4097903, no grad
            ([], 1.0)]
    lp, old, a, m = tokens(rows)
    res = GMPOClip()(lp, old, a, m)
    e3, e30, em3, e20 = 1.3498588075760032, 0.9672161004820059, 0.7408182206817179, 485165195.4097903
    torch.testing.assert_close(res.token_loss, torch.tensor(
        [[-e3, -e3, 0], [e30, e30, e30], [-em3, -em3, 0], [0, 0, 0], [e20, e20, 0], [0, 0, 0]]))
    # d token_loss[i, t] / d logp_t = -A_i e^{G_i} on unclipped tokens, 0 on clipped ones
    torch.testing.assert_close(grad(res, lp, m), torch.tensor(
        [[-e3, 0, 0], [0, e30, e30], [-em3, -em3, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]]))
    # seq-mean-token-mean (k_i = 1 / (B L_i), B = 5 non-empty rows): GMPO's -A_i e^{G_i} / (B L_i)
    torch.testing.assert_close(grad(res, lp, m, "seq-mean-token-mean")[0, 0], torch.tensor(-e3 / 10))
    assert res.clip_upper.int().tolist()[0] == [0, 1, 0] and res.clip_lower.int().tolist()[1] == [1, 0, 0]
    assert res.clipped.sum() == 2 and not res.clip_dual.any()
    assert res.in_band.int().tolist()[2] == [0, 1, 0] and res.in_band.int().tolist()[4] == [0, 0, 0]
    assert res.clip_cap.int().tolist()[4] == [1, 1, 0] and res.clip_cap.sum() == 2


# ---- LUSPO --------------------------------------------------------------------------------------
def luspo_rows():
    # (S, L, A), S / L on each token; GSPO band [1 - 3e-4, 1 + 4e-4] on s = e^{S/L}
    rows = [(0.001, 4, 1.0),     # s = e^2.5e-4 = 1.0002500312526044 in band: loss_i -1.00025
            (0.004, 4, 1.0),     # e^1e-3 > 1.0004: upper, -1.0004
            (-0.004, 2, -1.0),   # e^-2e-3 < 0.9997: lower, +0.9997
            (0.0005, 1, -1.0)]   # s = e^5e-4 = 1.0005001250208359 > 1.0004 but A < 0: unclipped, +1.0005
    return tokens([([s / L] * L, a) for s, L, a in rows])


def test_luspo_hand_computed():
    # J = (1/G) sum_i L_i loss_i = (4 (-1.00025003) + 4 (-1.0004) + 2 (0.9997) + 1 (1.00050013)) / 4
    #   = -1.2506749999973954
    lp, old, a, m = luspo_rows()
    res = LUSPOClip()(lp, old, a, m)
    loss = aggregate(res.token_loss, m, "seq-mean-token-sum").loss
    assert loss.item() == pytest.approx(-1.2506749999973954, rel=1e-6)
    reg, metrics = get_policy_loss_fn("luspo")(old, lp, a, m, "token-mean", None)  # the mode is LUSPO's own
    assert reg.item() == pytest.approx(-1.2506749999973954, rel=1e-6)
    # every token of an unclipped sequence: -A_i s_i / G, whatever L_i
    g = grad(res, lp, m, "seq-mean-token-sum")
    torch.testing.assert_close(g[0], torch.full((4,), -0.2500625078131511))
    torch.testing.assert_close(g[3, :1], torch.tensor([0.25012503125520896]))
    assert g[1:3].abs().sum() == 0
    # GSPO (seq-mean-token-mean) gives -A_i s_i / (G L_i): LUSPO's token weight is L_i times GSPO's
    g_gspo = grad(GSPOClip()(lp, old, a, m), lp, m, "seq-mean-token-mean")
    torch.testing.assert_close(g_gspo[0], torch.full((4,), -0.06251562695328777))
    assert col(res.clip_upper) == [0, 1, 0, 0] and col(res.clip_lower) == [0, 0, 1, 0]
    assert col(res.in_band) == [1, 0, 0, 0] and metrics["actor/pg_clipfrac_lower"] == 0.0


# ---- all four -----------------------------------------------------------------------------------
@pytest.mark.parametrize("rule", RULES, ids=lambda r: type(r).__name__)
def test_on_policy_is_minus_advantage_and_never_clipped(rule):
    lp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]])
    m = torch.tensor([[1, 1, 0], [1, 0, 0]])
    res = rule(lp, lp.clone(), torch.tensor([1.0, -2.0]), m)
    torch.testing.assert_close(res.token_loss, torch.tensor([[-1.0, -1.0, 0.0], [2.0, 0.0, 0.0]]))
    assert not res.clipped.any() and res.in_band[m.bool()].all() and not res.clip_cap.any()


@pytest.mark.parametrize("rule", RULES, ids=lambda r: type(r).__name__)
def test_extreme_log_ratios_and_long_sequences_stay_finite(rule):
    g = torch.Generator().manual_seed(0)
    B, T = 4, 32768
    lp = (torch.randn(B, T, generator=g) * 0.3).requires_grad_(True)
    old = torch.zeros(B, T)
    m = torch.ones(B, T)
    m[2, 100:] = 0
    m[3] = 0
    with torch.no_grad():
        lp[1, :50] = 400.0  # S in the tens of thousands
    adv = torch.tensor([1.0, -1.0, 2.0, 1.0])
    res = rule(lp, old, adv, m)
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "token-sum"):
        assert torch.isfinite(grad(res, lp, m, mode)).all(), mode
    assert torch.isfinite(res.token_loss).all() and res.token_loss[3].abs().sum() == 0
    for mask in (res.clip_upper, res.clip_lower, res.clip_dual, res.in_band, res.clip_cap):
        assert not mask[m == 0].any()


@pytest.mark.parametrize("rule", RULES, ids=lambda r: type(r).__name__)
def test_bf16_inputs_math_in_float32(rule):
    check_bf16(rule)  # the baselines' check: float32 math, identical losses, finite bf16 gradient


@pytest.mark.parametrize("rule", RULES, ids=lambda r: type(r).__name__)
def test_feeds_the_length_fairness_diagnostics(rule):
    """Every ClipResult field the other rules fill is there and counts (band/*, clip/*, fairness/*)."""
    lp, old, a, m = luspo_rows()
    fm = FairnessMetrics(LengthBins(edges=[0, 2, 8]))
    fm.update_clip(rule(lp.detach() * 3000, old, a, m), None, m, a)  # d up to 3: every rule's band is left
    out = fm.compute()
    assert {"band/out_frac", "clip/seq_frac", "clip/tok_frac", "fairness/lre"} <= set(out)
    assert 0 < out["band/out_frac"] <= 1 and all(math.isfinite(v) for v in out.values())


def test_theory_curves():
    L = np.array([0.0, 10.0, 1000.0])
    want = theory.c_gspo(L, 0.03, 4e-4, 3e-4)
    np.testing.assert_allclose(LUSPOClip().theory_clip_fraction(L, 0.03), want)  # GSPO's acceptance event
    for rule in (CISPOClip(), SAPOClip(), GMPOClip()):  # token-level clips: none, as GRPOClip
        assert rule.theory_clip_fraction(L, 0.03) is None and rule.level == "token"
    assert LUSPOClip().level == "sequence"


@pytest.mark.parametrize("cls, kw, name", [
    (CISPOClip, dict(clip_ratio_low=1.5), "clip_ratio_low"),
    (CISPOClip, dict(clip_ratio_high=-0.1), "clip_ratio_high"),
    (CISPOClip, dict(value="logp"), "value"),
    (SAPOClip, dict(tau_pos=0.0), "tau_pos"),
    (SAPOClip, dict(tau_neg=-1.0), "tau_neg"),
    (SAPOClip, dict(value="x"), "value"),
    (GMPOClip, dict(clip_ratio_low=0.0), "clip_ratio_low"),
    (GMPOClip, dict(clip_ratio_high=float("inf")), "clip_ratio_high"),
    (LUSPOClip, dict(clip_ratio_low=1.0), "clip_ratio_low")])
def test_bad_settings(cls, kw, name):
    with pytest.raises(ValueError, match=name):
        cls(**kw)


def test_registry_names_come_from_the_rule_files():
    assert {"cispo", "sapo", "geo_mean", "gmpo", "luspo"} <= set(POLICY_LOSSES)
    assert get_policy_loss_fn("geo_mean") is get_policy_loss_fn("gmpo")
    lp, old, a, m = luspo_rows()
    for name in ("cispo", "sapo", "geo_mean", "luspo"):
        loss, metrics = get_policy_loss_fn(name)(old, lp, a[:, None] * m, m, "token-mean", None)
        assert torch.isfinite(loss) and set(metrics) == {"actor/pg_clipfrac", "actor/ppo_kl",
                                                         "actor/pg_clipfrac_lower"}
