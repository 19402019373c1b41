"""Sequence weighting of the sequence-level rules: hand-computed per-token gradients.

Paper eq. obj-fspo (and eq. rloo) average the sequence surrogate over the G sequences, so
d J / d logp_{i,t} = A_i s_i / G on every token of every unclipped sequence, whatever its length.
Our rules make the sequence ratio per token (verl's stop-gradient form, fspo/clipping/base.py), so
with an aggregation weight k_i per token (fspo/losses.py) every token of sequence i gets

    d loss / d logp_{i,t} = -A_i s_i k_i          (0 where a clip binds)

    token-mean                k_i = 1 / N            N = sum_i L_i  (paper: constant G / N)
    seq-mean-token-mean       k_i = 1 / (B L_i)
    seq-mean-token-sum        k_i = 1 / B
    seq-mean-token-sum-norm   k_i = 1 / (B T)        (verl 0.9.1: divides by the batch and horizon)
    token-sum                 k_i = 1

and the named option ``ratio_grad="length_weighted"`` (the sequence surrogate with its full
gradient through S on each of its L_i tokens) gives L_i times that. s_i = exp(S_i) for FSPO and
RLOO, exp(S_i / L_i) for GSPO (whose per-token form is verl's; it has no length-weighted option).
"""
from __future__ import annotations

import math

import pytest
import torch
from hydra.utils import instantiate

from conftest import compose_config
from fspo.clipping import FSPOClip, GRPOClip, GSPOClip, RLOOClip
from fspo.clipping.registry import get_policy_loss_fn
from fspo.losses import aggregate

MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum")


def make(rows, T):
    """rows of (S, L, A) -> (log_prob [B, T] requiring grad with S/L per token, old 0, A [B], mask)."""
    lp, m = torch.zeros(len(rows), T), torch.zeros(len(rows), T)
    for i, (s, L, _) in enumerate(rows):
        m[i, :L] = 1
        lp[i, :L] = s / L
    return lp.requires_grad_(True), torch.zeros(len(rows), T), torch.tensor([a for *_, a in rows]), m


def k_of(mode, lengths, T):
    """The per-token aggregation weight k_i of each mode (module docstring), as python floats."""
    B, N = len(lengths), sum(lengths)
    return {"token-mean": [1 / N] * B, "seq-mean-token-mean": [1 / (B * L) for L in lengths],
            "seq-mean-token-sum": [1 / B] * B, "seq-mean-token-sum-norm": [1 / (B * T)] * B,
            "token-sum": [1.0] * B}[mode]


def grad_of(rule, rows, T, mode):
    lp, old, adv, m = make(rows, T)
    res = rule(lp, old, adv, m)
    (g,) = torch.autograd.grad(aggregate(res.token_loss, m, mode).loss, lp)
    return g, res, m


# (S, L, A, s_i or None where a clip binds). T = 16.
# FSPO c_upper = c_lower = 0.03, c_dual = 0.05: L = 4 -> band +-0.06, dual 0.10; L = 16 -> +-0.12, 0.20.
FSPO_ROWS = [
    (0.04, 4, 1.0, math.exp(0.04)),     # in band, A > 0
    (0.10, 4, 1.0, None),               # A > 0, S > hi: upper binds
    (-0.04, 16, -1.0, math.exp(-0.04)),  # in band, A < 0
    (-0.20, 16, -1.0, None),            # A < 0, S < lo: lower binds
    (0.30, 16, -0.5, None),             # A < 0, S > du: dual binds
    (0.15, 16, -0.5, math.exp(0.15)),   # A < 0, hi < S < du: out of band but unclipped (gradient flows)
    (-0.30, 16, 2.0, math.exp(-0.30)),  # A > 0, S < lo: unclipped (the min keeps exp(S) A)
    (0.0, 1, 2.0, 1.0),                 # L = 1, on the old policy
]
# RLOO low 0.4, high 0.667, dual 3 (ratio space on exp(S)).
RLOO_ROWS = [
    (0.3, 10, 1.0, math.exp(0.3)),      # 1.35 in [0.6, 1.667]
    (1.0, 10, 1.0, None),               # 2.72 > 1.667, A > 0: upper
    (-1.0, 5, -1.0, None),              # 0.37 < 0.6, A < 0: lower
    (1.5, 16, -1.0, None),              # 4.48 > 3, A < 0: dual
    (0.8, 16, -1.0, math.exp(0.8)),     # 2.23 in (1.667, 3), A < 0: unclipped
    (-1.0, 3, 1.0, math.exp(-1.0)),     # 0.37 < 0.6, A > 0: unclipped
]
# GSPO low 3e-4, high 4e-4 (ratio space on exp(S/L)), no dual.
GSPO_ROWS = [
    (0.001, 4, 1.0, math.exp(0.001 / 4)),     # S/L = 2.5e-4 in band
    (0.016, 16, 1.0, None),                   # S/L = 1e-3 > 4e-4, A > 0: upper
    (-0.016, 16, -1.0, None),                 # S/L = -1e-3, A < 0: lower
    (-0.016, 16, 1.0, math.exp(-0.016 / 16)),  # A > 0 below the band: unclipped
    (0.002, 8, -2.0, math.exp(0.002 / 8)),    # S/L = 2.5e-4 in band, A < 0
]
CASES = {
    "fspo": (lambda grad: FSPOClip(c_dual=0.05, ratio_grad=grad), FSPO_ROWS),
    "rloo": (lambda grad: RLOOClip(ratio_grad=grad), RLOO_ROWS),
    "gspo": (lambda grad: GSPOClip(), GSPO_ROWS),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name,ratio_grad", [("fspo", "per_token"), ("fspo", "length_weighted"),
                                             ("rloo", "per_token"), ("rloo", "length_weighted"),
                                             ("gspo", "per_token")])  # GSPO has only verl's per-token form
def test_per_token_gradient_every_rule_every_mode(name, ratio_grad, mode):
    build, rows = CASES[name]
    T = 16
    g, res, m = grad_of(build(ratio_grad), [r[:3] for r in rows], T, mode)
    lengths = [r[1] for r in rows]
    k = k_of(mode, lengths, T)
    for i, (_S, L, A, s) in enumerate(rows):
        coef = 0.0 if s is None else -A * s * k[i] * (L if ratio_grad == "length_weighted" else 1)
        want = torch.zeros(T)
        want[:L] = coef
        torch.testing.assert_close(g[i], want, rtol=1e-5, atol=1e-9, msg=f"{name} row {i} ({mode}, {ratio_grad})")
        assert bool(res.clipped[i, 0]) == (s is None), (name, i)


@pytest.mark.parametrize("name", ["fspo", "rloo"])
def test_length_weighted_has_same_value(name):
    build, rows = CASES[name]
    lp, old, adv, m = make([r[:3] for r in rows], 16)
    a, b = build("per_token")(lp, old, adv, m), build("length_weighted")(lp, old, adv, m)
    torch.testing.assert_close(a.token_loss, b.token_loss)
    for f in ("clip_upper", "clip_lower", "clip_dual", "in_band", "clip_cap"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f


def two_sequences():
    """The smallest case that shows the length bias: L = 10 and L = 100, new = old (S = 0), A = +1 for both."""
    T = 100
    lp, old = torch.zeros(2, T, requires_grad=True), torch.zeros(2, T)
    m = torch.zeros(2, T)
    m[0, :10] = 1
    m[1, :100] = 1
    return lp, old, torch.ones(2), m


@pytest.mark.parametrize("method", ["fspo", "rloo"])
@pytest.mark.parametrize("ratio_grad,short,long", [("per_token", -1 / 110, -1 / 110),
                                                    ("length_weighted", -10 / 110, -100 / 110)])
def test_l10_vs_l100_through_composed_preset(method, ratio_grad, short, long):
    # paper: equal per-token gradients, A exp(0) / G; token-mean gives 1 / sum L = 1 / 110 each
    cfg = compose_config([f"+method={method}", f"clip.ratio_grad={ratio_grad}"])
    assert cfg.loss_agg_mode == "token-mean"
    clip, agg = instantiate(cfg.clip), instantiate(cfg.aggregator)
    lp, old, adv, m = two_sequences()
    res = clip(lp, old, adv, m)
    (g,) = torch.autograd.grad(agg(res.token_loss, m).loss, lp)
    torch.testing.assert_close(g[0, :10], torch.full((10,), short))
    torch.testing.assert_close(g[1], torch.full((100,), long))
    assert g[0, 10:].abs().sum() == 0


def test_presets_default_to_the_papers_weighting():
    for method in ("fspo", "rloo"):
        assert instantiate(compose_config([f"+method={method}"]).clip).ratio_grad == "per_token"
    assert instantiate(compose_config([]).clip).ratio_grad == "per_token"  # the default run is FSPO


@pytest.mark.parametrize("name", ["fspo", "rloo"])
def test_l10_vs_l100_through_registry_token_mean(name):
    lp, old, adv, m = two_sequences()
    fn = get_policy_loss_fn(name)
    loss, _ = fn(old, lp, adv[:, None] * m, m, "token-mean", None)  # verl layout: [B, T] advantages
    (g,) = torch.autograd.grad(loss, lp)
    torch.testing.assert_close(g[0, :10], torch.full((10,), -1 / 110))
    torch.testing.assert_close(g[1], torch.full((100,), -1 / 110))
    loss, _ = fn(old, lp, adv[:, None] * m, m, "token-mean", {"ratio_grad": "length_weighted"})
    (g,) = torch.autograd.grad(loss, lp)
    torch.testing.assert_close(g[1], torch.full((100,), -100 / 110))


def test_acceptance_is_sign_free_and_differs_from_binding():
    # FSPO rows: out of band with A < 0 below du (row 5) and A > 0 below lo (row 6): not binding
    lp, old, adv, m = make([r[:3] for r in FSPO_ROWS], 16)
    res = FSPOClip(c_dual=0.05)(lp, old, adv, m)
    assert res.in_band[:, 0].tolist() == [True, False, True, False, False, False, False, True]
    assert res.clipped[:, 0].tolist() == [False, True, False, True, True, False, False, False]
    assert not res.in_band[m == 0].any()
    # RLOO: in band iff 0.6 <= exp(S) <= 1.667
    lp, old, adv, m = make([r[:3] for r in RLOO_ROWS], 16)
    assert RLOOClip()(lp, old, adv, m).in_band[:, 0].tolist() == [True, False, False, False, False, False]
    # GRPO: per token; token 0 ratio exp(0.1) in [0.8, 1.28], token 1 exp(0.5) = 1.65 out, token 2 exp(-0.3) = 0.74 out
    lp = torch.tensor([[0.1, 0.5, -0.3, 0.0]])
    res = GRPOClip()(lp, torch.zeros(1, 4), torch.tensor([-1.0]), torch.tensor([[1.0, 1.0, 1.0, 0.0]]))
    assert res.in_band[0].tolist() == [True, False, False, False]


@pytest.mark.parametrize("rule", [FSPOClip(c_dual=None), RLOOClip(clip_ratio_c=None)])
def test_float_cap_is_reported_as_cap_not_dual(rule):
    # A < 0 and S = 30 > 20 with no dual clip: the loss is held at the cap, zero gradient, reported as cap
    lp, old, adv, m = make([(30.0, 10, -1.0), (0.01, 10, -1.0)], 10)
    res = rule(lp, old, adv, m)
    assert res.clip_cap[:, 0].tolist() == [True, False]
    assert not res.clip_dual.any() and not res.clipped[0].any()
    (g,) = torch.autograd.grad(aggregate(res.token_loss, m, "token-mean").loss, lp)
    assert g[0].abs().sum() == 0 and g[1].abs().sum() > 0
    torch.testing.assert_close(res.token_loss[0, 0], torch.tensor(math.exp(20.0)))


def test_dual_still_reported_when_set():
    lp, old, adv, m = make([(30.0, 10, -1.0)], 10)
    res = FSPOClip()(lp, old, adv, m)
    assert res.clip_dual[0, 0] and not res.clip_cap.any()


def test_bad_ratio_grad_names_the_setting():
    with pytest.raises(ValueError, match="ratio_grad"):
        FSPOClip(ratio_grad="sequence")
    with pytest.raises(ValueError, match="ratio_grad"):
        RLOOClip(ratio_grad="x")
