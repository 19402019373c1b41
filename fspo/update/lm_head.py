"""Chunked LM-head log-probabilities: the [K, V] float32 logits are never held at once.

For final hidden states ``hidden`` [K, H], the LM-head ``weight`` [V, H] (optional ``bias`` [V]) and sampled
tokens ``targets`` [K]:

    z      = hidden @ weight.T (+ bias)                       [K, V], computed in float32
    logp_k = z_{k, y_k} / T - logsumexp_v(z_{k, v} / T)       (T = temperature)
    H_k    = logsumexp(z_k / T) - sum_v softmax(z_k / T)_v * z_{k, v} / T      (entropy, no gradient)

and, with g the incoming gradient [K] and D = g[:, None] * (onehot(y) - softmax(z / T)) / T [K, V]:

    d hidden = D @ weight          d weight = D.T @ hidden          d bias = D.sum(0)

The forward keeps only logsumexp and the target logit per row; the backward recomputes each chunk's logits.
Products run in the inputs' dtype, logits and the weight gradient in float32 (float64 for float64 inputs). Peak
extra memory ~ ``chunk_size * V * 8`` bytes plus the weight gradient (docs/memory.md). ``weight`` must be whole
on this device (under FSDP2 the caller runs inside the root's forward: `in_root_forward`).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable


def _acc_dtype(t: Tensor) -> torch.dtype:
    """float32 for float32 / bf16 / fp16 inputs, float64 for float64 ones (so gradcheck can run)."""
    return torch.promote_types(t.dtype, torch.float32)


def _chunk_logits(h: Tensor, weight: Tensor, bias: Optional[Tensor], temperature: float) -> Tensor:
    """float32 (float64 for float64 inputs) [n, V]: (h @ weight.T (+ bias)) / temperature."""
    z = h @ weight.t()
    if bias is not None:
        z += bias
    z = z.to(_acc_dtype(z))
    if temperature != 1.0:
        z /= temperature  # z is a fresh buffer: in place saves a chunk
    return z


class _ChunkedTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor,
                temperature: float, chunk_size: int, with_entropy: bool):
        k, acc = hidden.shape[0], _acc_dtype(weight)
        logp = torch.empty(k, dtype=acc, device=hidden.device)
        logz = torch.empty(k, dtype=acc, device=hidden.device)
        ent = torch.empty(k, dtype=acc, device=hidden.device) if with_entropy else None
        for s in range(0, k, chunk_size):
            e = min(s + chunk_size, k)
            z = _chunk_logits(hidden[s:e], weight, bias, temperature)
            lz = torch.logsumexp(z, dim=-1)
            logz[s:e] = lz
            logp[s:e] = z.gather(-1, targets[s:e].unsqueeze(-1)).squeeze(-1) - lz
            if with_entropy:
                # H = logz - sum p * z, with p = exp(z - logz) computed in place over the chunk
                zp = z.sub(lz.unsqueeze(-1)).exp_().mul_(z)
                ent[s:e] = lz - zp.sum(-1)
                del zp
            del z
        ctx.save_for_backward(hidden, weight, bias, targets, logz)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        if ent is not None:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp: Tensor, grad_ent: Optional[Tensor]):
        hidden, weight, bias, targets, logz = ctx.saved_tensors
        t, cs = ctx.temperature, ctx.chunk_size
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        k, acc = hidden.shape[0], logz.dtype
        grad_h = torch.zeros_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) \
            if (need_b and bias is not None) else None
        if grad_logp is None:
            grad_logp = torch.zeros(k, dtype=acc, device=hidden.device)
        grad_logp = grad_logp.to(acc)
        for s in range(0, k, cs):
            e = min(s + cs, k)
            h = hidden[s:e]
            z = _chunk_logits(h, weight, bias, t)
            # D = g * (onehot - softmax) / T, built in place in z's buffer
            d = z.sub_(logz[s:e].unsqueeze(-1)).exp_().neg_()
            d.scatter_add_(-1, targets[s:e].unsqueeze(-1), torch.ones(e - s, 1, dtype=d.dtype, device=d.device))
            d.mul_((grad_logp[s:e] / t).unsqueeze(-1))
            if grad_h is not None:  # in the weight's dtype, as autograd through `.float()` would
                grad_h[s:e] = (d.to(weight.dtype) @ weight).to(hidden.dtype)
            if grad_w is not None:
                grad_w.addmm_(d.t(), h.to(acc))
            if grad_b is not None:
                grad_b += d.sum(0)
            del d, z
        if grad_w is not None:
            grad_w = grad_w.to(weight.dtype)
        if grad_b is not None:
            grad_b = grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None


def chunked_token_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float = 1.0,
                           chunk_size: int = 4096, bias: Optional[Tensor] = None,
                           with_entropy: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
    """(logp [K] float32 (float64 for float64 inputs), entropy [K] or None) of ``targets`` under
    softmax((hidden @ weight.T (+ bias)) / temperature), ``chunk_size`` rows at a time; differentiable w.r.t.
    ``hidden``, ``weight`` and ``bias``, the entropy carrying no gradient."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden [K, H] and weight [V, H] expected, got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets [K={hidden.shape[0]}] expected, got {tuple(targets.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    args = (targets.long(), float(temperature), int(chunk_size), bool(with_entropy))
    device = hidden.device.type
    if not torch.is_autocast_enabled(device):
        return _ChunkedTokenLogprobs.apply(hidden, weight, bias, *args)
    # under autocast: cast as autocast casts a linear's (autograd ops: float32 gradients reach the weights),
    # then run with autocast off, so forward and backward's recomputed logits use the same bf16 product
    dtype = torch.get_autocast_dtype(device)
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    bias = bias.to(dtype) if bias is not None else None
    with torch.autocast(device_type=device, enabled=False):
        return _ChunkedTokenLogprobs.apply(hidden, weight, bias, *args)
