"""Aggregation modes: hand-computed values, per-sequence weights, micro-batch additivity."""
from __future__ import annotations

import pytest
import torch

from fspo.clipping import FSPOClip
from fspo.losses import AGG_MODES, Aggregator, aggregate

NAN = float("nan")


def example():
    # rows: L = 4, 2, 1, 0; padding holds garbage (NaN / 100) that must be ignored
    loss = torch.tensor([[1.0, 2.0, 3.0, 4.0],
                         [5.0, 6.0, NAN, 100.0],
                         [7.0, 100.0, 100.0, NAN],
                         [NAN, 9.0, 9.0, 9.0]], requires_grad=True)
    m = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    return loss, m


@pytest.mark.parametrize("mode, value, weights", [
    # token-mean: (1+2+3+4 + 5+6 + 7) / 7 tokens = 28 / 7 = 4; w_i = L_i / 7
    ("token-mean", 4.0, [4 / 7, 2 / 7, 1 / 7, 0.0]),
    # seq-mean-token-mean: (2.5 + 5.5 + 7) / 3 non-empty sequences = 5; w_i = 1/3
    ("seq-mean-token-mean", 5.0, [1 / 3, 1 / 3, 1 / 3, 0.0]),
    # seq-mean-token-sum: (10 + 11 + 7) / 3 = 9.3333; w_i = L_i / 3
    ("seq-mean-token-sum", 28 / 3, [4 / 3, 2 / 3, 1 / 3, 0.0]),
    # seq-mean-token-sum-norm (verl 0.9.1): 28 / (3 sequences * T = 4) = 2.3333; w_i = L_i / 12
    ("seq-mean-token-sum-norm", 28 / 12, [4 / 12, 2 / 12, 1 / 12, 0.0]),
    # token-sum: 28; w_i = L_i
    ("token-sum", 28.0, [4.0, 2.0, 1.0, 0.0]),
])
def test_hand_computed(mode, value, weights):
    loss, m = example()
    out = aggregate(loss, m, mode)
    assert out.loss.item() == pytest.approx(value, rel=1e-6)
    torch.testing.assert_close(out.seq_weights, torch.tensor(weights))
    (g,) = torch.autograd.grad(out.loss, loss)
    assert torch.isfinite(g).all() and g[m == 0].abs().sum() == 0


def test_explicit_denominators():
    loss, m = example()
    assert aggregate(loss, m, "token-mean", total_tokens=14).loss.item() == pytest.approx(2.0)
    assert aggregate(loss, m, "seq-mean-token-mean", total_seqs=6).loss.item() == pytest.approx(2.5)
    assert aggregate(loss, m, "seq-mean-token-sum", total_seqs=torch.tensor(4)).loss.item() == pytest.approx(7.0)
    # 28 / (3 * 8) and 28 / (7 * 4)
    assert aggregate(loss, m, "seq-mean-token-sum-norm", norm_len=8).loss.item() == pytest.approx(7 / 6)
    assert aggregate(loss, m, "seq-mean-token-sum-norm", total_seqs=7, norm_len=4).loss.item() == pytest.approx(1.0)
    # token-sum has no denominator: 28 whatever is passed
    assert aggregate(loss, m, "token-sum", total_tokens=14, total_seqs=6, norm_len=8).loss.item() == pytest.approx(28.0)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_seq_weights_reconstruct_loss(mode):
    g = torch.Generator().manual_seed(0)
    B, T = 16, 30
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    m = (torch.arange(T) < lengths[:, None]).long()
    loss = torch.randn(B, T, generator=g) * m
    out = aggregate(loss, m, mode)
    seq_mean = loss.sum(-1) / lengths.clamp(min=1)
    torch.testing.assert_close(out.loss, (out.seq_weights * seq_mean).sum())


def test_token_mean_value_and_per_token_gradient_weights():
    # L = (1, 9), a per-sequence value (10, 0) repeated on each sequence's tokens: the token-mean
    # value counts sequence i L_i times (w = L_i / 10): 10 * 1 / 10 = 1; seq-mean-token-mean = 5.
    # The gradient weight per token is k_i: 1 / 10 for every token of both sequences under token-mean
    # (so a per-token ratio gradient weights sequences equally); 1 / (2 L_i) under seq-mean-token-mean.
    m = torch.zeros(2, 9)
    m[0, :1] = 1
    m[1, :] = 1
    tok = (torch.tensor([10.0, 0.0])[:, None] * m).requires_grad_(True)
    out = aggregate(tok, m, "token-mean")
    assert out.loss.item() == pytest.approx(1.0)
    torch.testing.assert_close(out.seq_weights, torch.tensor([0.1, 0.9]))
    (g,) = torch.autograd.grad(out.loss, tok)
    torch.testing.assert_close(g, 0.1 * m)
    out = aggregate(tok, m, "seq-mean-token-mean")
    assert out.loss.item() == pytest.approx(5.0)
    (g,) = torch.autograd.grad(out.loss, tok)
    torch.testing.assert_close(g[0, 0], torch.tensor(0.5))
    torch.testing.assert_close(g[1], torch.full((9,), 1 / 18))


@pytest.mark.parametrize("mode", AGG_MODES)
def test_micro_batches_sum_to_mini_batch(mode):
    g = torch.Generator().manual_seed(1)
    B, T = 12, 40
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    lengths[3] = 0
    m = (torch.arange(T) < lengths[:, None]).float()
    lp = (torch.randn(B, T, generator=g) * 0.05).requires_grad_(True)
    olp = torch.randn(B, T, generator=g) * 0.05
    adv = torch.randn(B, generator=g)
    rule = FSPOClip(c_upper=0.02, c_lower=0.02, c_dual=0.02)
    full = aggregate(rule(lp, olp, adv, m).token_loss, m, mode)
    (g_full,) = torch.autograd.grad(full.loss, lp)
    totals = dict(total_tokens=m.sum(), total_seqs=(lengths > 0).sum(), norm_len=T)
    parts, weights = [], []
    for idx in (torch.arange(0, 5), torch.arange(5, 9), torch.arange(9, 12)):
        t_keep = max(1, int(lengths[idx].max()))  # micro-batches are trimmed to their own max length
        sub = [x[idx, :t_keep] for x in (lp, olp, m)]
        out = aggregate(rule(sub[0], sub[1], adv[idx], sub[2]).token_loss, sub[2], mode, **totals)
        parts.append(out.loss)
        weights.append(out.seq_weights)
    total = torch.stack(parts).sum()
    torch.testing.assert_close(total, full.loss)
    torch.testing.assert_close(torch.cat(weights), full.seq_weights)
    (g_micro,) = torch.autograd.grad(total, lp)
    torch.testing.assert_close(g_micro, g_full)


def test_clipped_sequences_stay_in_denominator():
    # row 0 is clipped (A > 0, S = 1 far above the band): it adds its tokens to the denominator
    m = torch.ones(2, 4)
    lp = torch.tensor([[0.25] * 4, [0.005] * 4], requires_grad=True)
    res = FSPOClip()(lp, torch.zeros(2, 4), torch.tensor([1.0, 1.0]), m)
    assert res.clipped[0].all() and not res.clipped[1].any()
    out = aggregate(res.token_loss, m, "token-mean")
    # (4 * -exp(0.06) + 4 * -exp(0.02)) / 8 tokens
    assert out.loss.item() == pytest.approx((-1.0618365465453596 - 1.0202013400267558) / 2, rel=1e-6)


def test_zero_denominator_gives_zero_loss():
    loss = torch.randn(2, 3, requires_grad=True)
    m = torch.zeros(2, 3)
    for mode in AGG_MODES:
        out = aggregate(loss, m, mode)
        assert out.loss.item() == 0.0 and out.loss.requires_grad
        (g,) = torch.autograd.grad(out.loss, loss)
        assert torch.isfinite(g).all()


def test_unknown_mode_and_bad_shapes():
    loss, m = example()
    with pytest.raises(ValueError, match="token-mean.*seq-mean-token-sum-norm"):
        aggregate(loss, m, "sequence-mean")
    with pytest.raises(ValueError, match=r"token_loss shape \(4, 4\).*\(4, 3\)"):
        aggregate(loss, m[:, :3], "token-mean")
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        Aggregator(mode="mean")
    with pytest.raises(ValueError, match="norm_len"):
        Aggregator(mode="seq-mean-token-sum-norm", norm_len=0)


def test_aggregator_delegates():
    loss, m = example()
    agg = Aggregator("seq-mean-token-sum-norm", norm_len=8)
    assert agg(loss, m).loss.item() == pytest.approx(28 / 24)
    assert agg(loss, m, norm_len=4).loss.item() == pytest.approx(28 / 24)  # the configured constant wins
    unset = Aggregator("seq-mean-token-sum-norm")
    assert unset(loss, m, norm_len=4).loss.item() == pytest.approx(28 / 12)  # the call's width otherwise
    assert agg(loss, m, total_seqs=2).loss.item() == pytest.approx(28 / 16)
    assert Aggregator("token-sum")(loss, m).loss.item() == pytest.approx(28.0)
    assert Aggregator()(loss, m).loss.item() == pytest.approx(4.0)
    assert "token-mean" in repr(Aggregator())
