"""GRPO, RLOO and GSPO clip rules: hand-computed values, gradients, numerics, validation, yamls."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate

from conftest import clip_config
from fspo.clipping import ClipRule, FSPOClip, GRPOClip, GSPOClip, RLOOClip
from fspo.losses import aggregate

CONF = Path(__file__).resolve().parents[1] / "conf" / "clip"


def make(rows, T=None, dtype=torch.float32):
    """rows of (S, L, A) -> log_prob (S/L per token, requires grad), old 0, A [B], mask."""
    T = T or max(1, max(L for _, L, _ in rows))
    lp, m = torch.zeros(len(rows), T), torch.zeros(len(rows), T)
    for i, (s, L, _) in enumerate(rows):
        m[i, :L] = 1
        if L:
            lp[i, :L] = s / L
    return (lp.to(dtype).requires_grad_(True), torch.zeros(len(rows), T, dtype=dtype),
            torch.tensor([a for *_, a in rows]), m)


def seq_loss(res, m):
    return res.token_loss.sum(-1) / m.sum(-1).clamp(min=1)


def all_finite(res, lp, m):
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        loss = aggregate(res.token_loss, m, mode).loss
        (g,) = torch.autograd.grad(loss, lp, retain_graph=True)
        assert torch.isfinite(loss) and torch.isfinite(g).all(), mode
    assert torch.isfinite(res.token_loss).all()


def test_grpo_hand_computed():
    # one token per row (L = 1), ratio r = exp(clamp(d, -20, 20)), band [0.8, 1.28], dual 3
    rows = [(0.1, 1, 1.0),     # r = 1.10517 in band:       -r        = -1.1051709180756477
            (0.5, 1, 1.0),     # r = 1.64872 > 1.28: upper  -1.28
            (-0.5, 1, 1.0),    # r = 0.60653, A > 0: unclipped -0.6065306597126334
            (-0.5, 1, -1.0),   # max(0.60653, 0.8) = 0.8: lower
            (0.5, 1, -1.0),    # max(1.64872, 1.28) = 1.64872 < 3: unclipped 1.6487212707001282
            (2.0, 1, -1.0),    # r = 7.389: min(7.389, 3) = 3: dual
            (30.0, 1, -2.0),   # clamp 20: dual -> 2 * 3 = 6
            (30.0, 1, 1.0),    # upper -1.28
            (-30.0, 1, 1.0),   # clamp -20: -exp(-20) = -2.061153622438558e-09
            (1000.0, 1, 0.0),  # A = 0 -> 0
            (0.0, 0, 4.0)]     # L = 0 -> 0
    lp, olp, a, m = make(rows)
    res = GRPOClip()(lp, olp, a, m)
    want = torch.tensor([-1.1051709180756477, -1.28, -0.6065306597126334, 0.8, 1.6487212707001282,
                         3.0, 6.0, -1.28, -2.061153622438558e-09, 0.0, 0.0])
    torch.testing.assert_close(seq_loss(res, m), want)
    assert res.clip_upper[:, 0].tolist() == [0, 1, 0, 0, 0, 0, 0, 1, 0, 0, 0]
    assert res.clip_lower[:, 0].tolist() == [0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0]
    assert res.clip_dual[:, 0].tolist() == [0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0]
    all_finite(res, lp, m)


def test_grpo_token_gradient_and_long_sequence():
    # token-mean grad of an unclipped token = -A r_t / N; clipped tokens get 0. L = 32768 row.
    g = torch.Generator().manual_seed(3)
    B, T = 3, 32768
    m = torch.ones(B, T)
    m[1, 100:] = 0
    m[2, :] = 0
    lp = (torch.randn(B, T, generator=g) * 0.2).requires_grad_(True)
    olp = torch.zeros(B, T)
    adv = torch.tensor([1.5, -0.5, 2.0])
    res = GRPOClip()(lp, olp, adv, m)
    (grad,) = torch.autograd.grad(aggregate(res.token_loss, m, "token-mean").loss, lp)
    r = torch.exp(lp.detach())
    want = torch.where(res.clipped, 0.0, -adv[:, None] * r / m.sum()) * m
    torch.testing.assert_close(grad, want)
    assert res.clipped.any() and res.token_loss[2].abs().sum() == 0


def test_rloo_hand_computed():
    # s = exp(clamp(S, -20, 20)), band [0.6, 1.667], dual 3
    rows = [(0.3, 10, 1.0),         # s = 1.34986 in band: -1.3498588075760032
            (1.0, 10, 1.0),         # s = 2.718 > 1.667:   upper -1.667
            (-1.0, 10, -1.0),       # s = 0.368 < 0.6:     lower 0.6
            (1.5, 10, -1.0),        # s = 4.48 > 3:        dual 3.0
            (1000.0, 32768, 1.0),   # clamp 20: upper -1.667
            (-1000.0, 100, 1.0),    # clamp -20, unclipped: -exp(-20) = -2.061153622438558e-09
            (1000.0, 100, 0.0),     # A = 0 -> 0
            (0.0, 0, 1.0)]          # L = 0 -> 0
    lp, olp, a, m = make(rows)
    res = RLOOClip()(lp, olp, a, m)
    want = torch.tensor([-1.3498588075760032, -1.667, 0.6, 3.0, -1.667, -2.061153622438558e-09, 0.0, 0.0])
    torch.testing.assert_close(seq_loss(res, m), want)
    assert res.clip_upper[:, 0].tolist() == [0, 1, 0, 0, 1, 0, 0, 0]
    assert res.clip_lower[:, 0].tolist() == [0, 0, 1, 0, 0, 0, 0, 0]
    assert res.clip_dual[:, 0].tolist() == [0, 0, 0, 1, 0, 0, 0, 0]
    all_finite(res, lp, m)
    # gradient: row 0 unclipped, per token -(1/N) A exp(S) = -(1/N) * 1.34986 (paper eq. rloo's weight)
    (grad,) = torch.autograd.grad(aggregate(res.token_loss, m, "token-mean").loss, lp)
    n = m.sum()
    torch.testing.assert_close(grad[0, :10], torch.full((10,), -(1 / n) * math.exp(0.3)))
    assert grad[1:5].abs().sum() == 0


def test_gspo_hand_computed():
    # s = exp(clamp(S/L, max=10)), band [1 - 3e-4, 1 + 4e-4], no dual
    rows = [(0.001, 4, 1.0),      # S/L = 2.5e-4: s = 1.0002500312526044 in band
            (0.004, 4, 1.0),      # 1e-3 > 4e-4: upper -1.0004
            (-0.004, 4, -1.0),    # e^-0.001 = 0.9990005 < 0.9997: lower 0.9997
            (-0.004, 4, 1.0),     # A > 0: unclipped -0.999000499833375
            (1000.0, 100, -1.0),  # S/L = 10: s = e^10, no dual: 22026.465794806718
            (10000.0, 100, -1.0), # S/L = 100, clamp 10: 22026.465794806718
            (1000.0, 32768, 1.0), # S/L = 0.0305 > 4e-4: upper -1.0004
            (1000.0, 100, 0.0),   # A = 0 -> 0
            (0.0, 0, 1.0)]        # L = 0 -> 0
    lp, olp, a, m = make(rows)
    res = GSPOClip()(lp, olp, a, m)
    want = torch.tensor([-1.0002500312526044, -1.0004, 0.9997, -0.999000499833375, 22026.465794806718,
                         22026.465794806718, -1.0004, 0.0, 0.0])
    torch.testing.assert_close(seq_loss(res, m), want)
    assert res.clip_upper[:, 0].tolist() == [0, 1, 0, 0, 0, 0, 1, 0, 0]
    assert res.clip_lower[:, 0].tolist() == [0, 0, 1, 0, 0, 0, 0, 0, 0]
    assert not res.clip_dual.any()
    all_finite(res, lp, m)
    # token form: d s_{i,t} / d logp_t = s_i, so token-mean grad of row 0 = -(1/N) A s_0 per token
    (grad,) = torch.autograd.grad(aggregate(res.token_loss, m, "token-mean").loss, lp)
    torch.testing.assert_close(grad[0, :4], torch.full((4,), -1.0002500312526044 / m.sum()))
    assert grad[1:3].abs().sum() == 0 and grad[5].abs().sum() == 0  # clipped / clamped above 10


@pytest.mark.parametrize("rule", [GRPOClip(), RLOOClip(), GSPOClip()])
def test_bf16_inputs_math_in_float32(rule):
    torch.manual_seed(0)
    lp = (torch.randn(4, 16) * 0.05).to(torch.bfloat16).requires_grad_(True)
    old = (torch.randn(4, 16) * 0.05).to(torch.bfloat16)
    m = torch.ones(4, 16)
    m[3, 5:] = 0
    adv = torch.tensor([1.0, -1.0, 0.3, -2.0])
    r16 = rule(lp, old, adv, m)
    r32 = rule(lp.detach().float(), old.float(), adv, m)
    assert r16.token_loss.dtype == torch.float32
    torch.testing.assert_close(r16.token_loss, r32.token_loss, rtol=0, atol=0)
    (g,) = torch.autograd.grad(aggregate(r16.token_loss, m, "token-mean").loss, lp)
    assert g.dtype == torch.bfloat16 and torch.isfinite(g).all()


def test_all_clipped_batch_baselines():
    # every row binds: zero gradient everywhere
    rows = [(1.0, 1, 1.0), (-1.0, 1, -1.0), (5.0, 1, -1.0)]
    lp, olp, a, m = make(rows)
    for rule in (GRPOClip(), RLOOClip()):
        res = rule(lp, olp, a, m)
        assert res.clipped[:, 0].all()
        (g,) = torch.autograd.grad(aggregate(res.token_loss, m, "token-mean").loss, lp)
        assert g.abs().sum() == 0
    lp, olp, a, m = make([(0.01, 4, 1.0), (-0.01, 4, -1.0)])
    res = GSPOClip()(lp, olp, a, m)
    assert res.clipped[:, 0].all()


@pytest.mark.parametrize("cls, kw, name", [
    (GRPOClip, dict(clip_ratio_low=-0.1), "clip_ratio_low"),
    (GRPOClip, dict(clip_ratio_low=1.0), "clip_ratio_low"),
    (GRPOClip, dict(clip_ratio_high=-0.2), "clip_ratio_high"),
    (GRPOClip, dict(clip_ratio_c=1.0), "clip_ratio_c"),
    (RLOOClip, dict(clip_ratio_low=1.5), "clip_ratio_low"),
    (RLOOClip, dict(clip_ratio_c=0.5), "clip_ratio_c"),
    (GSPOClip, dict(clip_ratio_high=-4e-4), "clip_ratio_high")])
def test_bad_settings(cls, kw, name):
    with pytest.raises(ValueError, match=name):
        cls(**kw)


def test_shape_mismatch():
    for rule in (GRPOClip(), RLOOClip(), GSPOClip()):
        with pytest.raises(ValueError, match=r"response_mask shape \(2, 5\).*\(2, 4\)"):
            rule(torch.zeros(2, 4), torch.zeros(2, 4), torch.zeros(2), torch.ones(2, 5))


def test_paper_defaults_and_rloo_ablation_range():
    assert (GRPOClip().clip_ratio_low, GRPOClip().clip_ratio_high, GRPOClip().clip_ratio_c) == (0.2, 0.28, 3.0)
    assert (RLOOClip().clip_ratio_low, RLOOClip().clip_ratio_high) == (0.4, 0.667)
    assert (GSPOClip().clip_ratio_low, GSPOClip().clip_ratio_high, GSPOClip().clip_ratio_c) == (3e-4, 4e-4, None)
    RLOOClip(clip_ratio_low=0.95, clip_ratio_high=20.0)  # the paper's "larger clip range" ablation


@pytest.mark.parametrize("path", sorted(CONF.glob("*.yaml")), ids=lambda p: p.stem)
def test_clip_yamls_instantiate(path):
    rule = instantiate(clip_config(path.stem))
    assert isinstance(rule, ClipRule) and rule.level in ("token", "sequence")
    lp, olp, a, m = make([(0.01, 3, 1.0), (-0.02, 5, -1.0)])
    res = rule(lp, olp, a, m)
    assert torch.isfinite(res.token_loss).all()


def test_clip_yamls_spell_out_paper_defaults():
    assert {p.stem for p in CONF.glob("*.yaml")} >= {"fspo", "fspo_ema", "grpo", "rloo", "gspo"}
    f = instantiate(clip_config("fspo"))
    assert isinstance(f, FSPOClip) and (f.c_upper, f.c_lower, f.c_dual, f.band) == (0.03, 0.03, 0.03, "fixed")
    e = instantiate(clip_config("fspo_ema"))
    assert (e.band, e.z, e.sigma_hat.item()) == ("ema", 1.0, pytest.approx(0.03))
