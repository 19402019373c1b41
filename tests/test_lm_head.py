"""Chunked LM-head log-probs (fspo/update/lm_head.py): a tiny case by hand (plain Python math from
logp = z_y/T - logsumexp(z/T) and d logp/d z = (onehot - softmax)/T), equality with the dense
log_softmax + autograd reference over random shapes / temperatures / chunk sizes / bias, a float64
gradcheck, bf16 inputs, a tied weight, and K = 0."""
from __future__ import annotations

import math

import pytest
import torch

from fspo.update.lm_head import chunked_token_logprobs

# ---- by hand -------------------------------------------------------------------------------------

H_ROWS = [[1.0, 0.0], [0.0, 2.0]]             # hidden [K=2, H=2]
W_ROWS = [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]  # weight [V=3, H=2]
TARGETS = [0, 2]
GRAD_OUT = [1.0, 0.5]                          # d loss / d logp_k (loss = sum_k g_k logp_k)


def by_hand(temperature):
    """logp, entropy, d hidden, d weight from the formulas, in plain Python."""
    t = temperature
    # z_kv = h_k . w_v:  row 0 -> [1, 0, 1], row 1 -> [0, 2, 2]
    z = [[sum(a * b for a, b in zip(h, w)) for w in W_ROWS] for h in H_ROWS]
    assert z == [[1.0, 0.0, 1.0], [0.0, 2.0, 2.0]]
    logp, ent, dz = [], [], []
    for k, zk in enumerate(z):
        s = [v / t for v in zk]
        logz = math.log(sum(math.exp(v) for v in s))
        p = [math.exp(v - logz) for v in s]
        logp.append(s[TARGETS[k]] - logz)
        ent.append(-sum(pv * math.log(pv) for pv in p))
        dz.append([GRAD_OUT[k] * ((1.0 if v == TARGETS[k] else 0.0) - p[v]) / t for v in range(3)])
    dh = [[sum(dz[k][v] * W_ROWS[v][j] for v in range(3)) for j in range(2)] for k in range(2)]
    dw = [[sum(dz[k][v] * H_ROWS[k][j] for k in range(2)) for j in range(2)] for v in range(3)]
    return logp, ent, dh, dw


def test_by_hand_values_at_t1():
    # spelled out: row 0 logits [1, 0, 1], target 0 -> logp = 1 - log(2e + 1);
    #              row 1 logits [0, 2, 2], target 2 -> logp = 2 - log(1 + 2e^2)
    logp, ent, dh, dw = by_hand(1.0)
    e = math.e
    assert logp[0] == pytest.approx(1 - math.log(2 * e + 1))
    assert logp[1] == pytest.approx(2 - math.log(1 + 2 * e * e))
    p0 = [e / (2 * e + 1), 1 / (2 * e + 1), e / (2 * e + 1)]
    assert ent[0] == pytest.approx(-sum(p * math.log(p) for p in p0))
    # d hidden_0 = (onehot(0) - p0) @ W = (1 - p0_0 - p0_2... ) : [1 - p0_0 - p0_2, -p0_1 - p0_2]
    assert dh[0] == pytest.approx([1 - p0[0] - p0[2], -p0[1] - p0[2]])
    # d weight_1 = sum_k g_k (onehot - p)_k1 h_k = -p0_1 * [1, 0] + 0.5 * (-p1_1) * [0, 2]
    p1 = [1 / (1 + 2 * e * e), e * e / (1 + 2 * e * e), e * e / (1 + 2 * e * e)]
    assert dw[1] == pytest.approx([-p0[1], -p1[1]])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [1, 2, 4096])
def test_matches_hand_computation(temperature, chunk_size):
    logp_x, ent_x, dh_x, dw_x = by_hand(temperature)
    h = torch.tensor(H_ROWS, requires_grad=True)
    w = torch.tensor(W_ROWS, requires_grad=True)
    logp, ent = chunked_token_logprobs(h, w, torch.tensor(TARGETS), temperature=temperature,
                                       chunk_size=chunk_size, with_entropy=True)
    assert logp.dtype == ent.dtype == torch.float32
    assert logp.tolist() == pytest.approx(logp_x, abs=1e-6)
    assert ent.tolist() == pytest.approx(ent_x, abs=1e-6)
    assert not ent.requires_grad
    (logp * torch.tensor(GRAD_OUT)).sum().backward()
    for got, want in zip(h.grad.tolist(), dh_x):
        assert got == pytest.approx(want, abs=1e-6)
    for got, want in zip(w.grad.tolist(), dw_x):
        assert got == pytest.approx(want, abs=1e-6)


# ---- against the dense reference -----------------------------------------------------------------

def dense(h, w, y, temperature=1.0, bias=None):
    """response_log_probs's computation on full logits: (logp, entropy), autograd through logp."""
    z = h @ w.t()
    if bias is not None:
        z = z + bias
    z = z.float() / temperature
    lsm = torch.log_softmax(z, dim=-1)
    logp = lsm.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        ent = -(lsm.exp() * lsm).sum(-1)
    return logp, ent


def leaves(*ts):
    return [t.detach().clone().requires_grad_(True) for t in ts]


@pytest.mark.parametrize("k,hdim,v", [(7, 5, 11), (13, 8, 33), (1, 3, 2)])
@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
@pytest.mark.parametrize("chunk", ["1", "3", "K", ">K"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_dense(k, hdim, v, temperature, chunk, with_bias):
    g = torch.Generator().manual_seed(k * 100 + v)
    h0 = torch.randn(k, hdim, generator=g)
    w0 = torch.randn(v, hdim, generator=g)
    b0 = torch.randn(v, generator=g) if with_bias else None
    y = torch.randint(0, v, (k,), generator=g)
    gout = torch.randn(k, generator=g)
    cs = {"1": 1, "3": 3, "K": k, ">K": k + 5}[chunk]

    hr, wr = leaves(h0, w0)
    br = leaves(b0)[0] if with_bias else None
    lr, er = dense(hr, wr, y, temperature, br)
    (lr * gout).sum().backward()

    hc, wc = leaves(h0, w0)
    bc = leaves(b0)[0] if with_bias else None
    lc, ec = chunked_token_logprobs(hc, wc, y, temperature=temperature, chunk_size=cs, bias=bc,
                                    with_entropy=True)
    (lc * gout).sum().backward()

    torch.testing.assert_close(lc, lr, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ec, er, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hc.grad, hr.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(wc.grad, wr.grad, atol=1e-5, rtol=1e-5)
    if with_bias:
        torch.testing.assert_close(bc.grad, br.grad, atol=1e-5, rtol=1e-5)


def test_without_entropy_returns_none():
    h, w = torch.randn(4, 3), torch.randn(6, 3)
    logp, ent = chunked_token_logprobs(h, w, torch.tensor([0, 1, 5, 2]), chunk_size=3)
    assert ent is None and logp.shape == (4,)


@pytest.mark.parametrize("chunk_size", [1, 2, 5])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gradcheck_float64(chunk_size, with_bias):
    g = torch.Generator().manual_seed(3)
    h = torch.randn(4, 3, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(5, 3, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(5, dtype=torch.float64, generator=g, requires_grad=True) if with_bias else None
    y = torch.tensor([4, 0, 2, 2])

    def f(h, w, *b):
        return chunked_token_logprobs(h, w, y, temperature=0.8, chunk_size=chunk_size,
                                      bias=b[0] if b else None)[0]

    assert torch.autograd.gradcheck(f, (h, w) + ((b,) if with_bias else ()), eps=1e-6, atol=1e-6)


def test_tied_weight_gradients_add():
    """The LM head tied to the embedding: gradients from both uses accumulate on one leaf."""
    g = torch.Generator().manual_seed(7)
    w0, ids, y = torch.randn(9, 4, generator=g), torch.tensor([1, 3, 3, 8, 0]), torch.tensor([2, 2, 0, 7, 5])
    grads = []
    for fn in (lambda h, w: dense(h, w, y, 0.9)[0],
               lambda h, w: chunked_token_logprobs(h, w, y, temperature=0.9, chunk_size=2)[0]):
        (w,) = leaves(w0)
        h = torch.tanh(w[ids] * 1.5)  # "embedding" of ids, then a body
        fn(h, w).sum().backward()
        grads.append(w.grad)
    torch.testing.assert_close(grads[1], grads[0], atol=1e-5, rtol=1e-5)


# ---- bf16 ----------------------------------------------------------------------------------------

def test_bf16_close_to_float32_reference():
    g = torch.Generator().manual_seed(11)
    k, hdim, v = 37, 16, 257
    h0 = torch.randn(k, hdim, generator=g).bfloat16()
    w0 = (torch.randn(v, hdim, generator=g) * 0.5).bfloat16()
    y = torch.randint(0, v, (k,), generator=g)

    h32, w32 = leaves(h0.float(), w0.float())  # the same values, float32 arithmetic
    l32, e32 = dense(h32, w32, y, 0.8)
    l32.sum().backward()

    hb, wb = leaves(h0, w0)
    lb, eb = chunked_token_logprobs(hb, wb, y, temperature=0.8, chunk_size=10, with_entropy=True)
    lb.sum().backward()

    assert lb.dtype == eb.dtype == torch.float32
    assert hb.grad.dtype == wb.grad.dtype == torch.bfloat16
    torch.testing.assert_close(lb, l32, atol=0.1, rtol=0.02)
    torch.testing.assert_close(eb, e32, atol=0.1, rtol=0.02)
    torch.testing.assert_close(hb.grad.float(), h32.grad, atol=0.05, rtol=0.05)
    torch.testing.assert_close(wb.grad.float(), w32.grad, atol=0.05, rtol=0.05)

    # and with the dense bf16 path (autograd through `.float()`), the same to bf16 rounding
    hd, wd = leaves(h0, w0)
    ld, _ = dense(hd, wd, y, 0.8)
    ld.sum().backward()
    torch.testing.assert_close(lb, ld, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hb.grad.float(), hd.grad.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(wb.grad.float(), wd.grad.float(), atol=2e-2, rtol=2e-2)


# ---- K = 0 ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("with_bias", [False, True])
def test_empty(with_bias):
    h = torch.zeros(0, 4, requires_grad=True)
    w = torch.randn(6, 4, requires_grad=True)
    b = torch.randn(6, requires_grad=True) if with_bias else None
    logp, ent = chunked_token_logprobs(h, w, torch.zeros(0, dtype=torch.long), bias=b, with_entropy=True)
    assert logp.shape == ent.shape == (0,) and logp.dtype == ent.dtype == torch.float32
    logp.sum().backward()
    assert h.grad.shape == (0, 4)
    assert torch.equal(w.grad, torch.zeros(6, 4))
    if with_bias:
        assert torch.equal(b.grad, torch.zeros(6))


def test_bad_arguments():
    h, w, y = torch.randn(3, 4), torch.randn(5, 4), torch.tensor([0, 1, 2])
    with pytest.raises(ValueError):
        chunked_token_logprobs(h, torch.randn(5, 3), y)
    with pytest.raises(ValueError):
        chunked_token_logprobs(h, w, y[:2])
    with pytest.raises(ValueError):
        chunked_token_logprobs(h, w, y, chunk_size=0)
    with pytest.raises(ValueError):
        chunked_token_logprobs(h, w, y, temperature=0.0)
