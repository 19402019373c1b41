"""Shared pieces of the clipping rules: input checks, masked sums, verl's ratio-space clip (`ratio_clip`,
`RatioClipRule`: GRPO, RLOO, GSPO), the two gradient forms of a sequence ratio, the float-safety cap, and the
`ClipResult` builders of the sequence rules and the weight-clipping token rules (CISPO, SAPO).
"""
from __future__ import annotations

from typing import ClassVar, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from fspo.clipping.base import ClipResult, ClipRule
from fspo.clipping.settings import (  # noqa: F401  (the rules import these from here)
    RATIO_GRADS,
    VALUE_FORMS,
    RatioClipSettings,
    check_choice,
    check_positive,
)

#: the float-safety cap on log-ratios, verl's clamp before exp (exp(20) = 4.85e8)
MAX_LOG_RATIO = 20.0


class Prepared(NamedTuple):
    """float32 views of a rule's inputs: ``mask`` bool [B, T], ``maskf`` float [B, T], ``lengths`` [B]."""

    log_prob: Tensor
    old_log_prob: Tensor
    mask: Tensor
    maskf: Tensor
    lengths: Tensor


def prepare(owner: str, log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor,
            response_mask: Tensor) -> Prepared:
    """Check that log_prob, old_log_prob, response_mask are [B, T] and advantages [B] or [B, T] (ValueError naming
    the shapes); upcast to float32 (bf16 included)."""
    if log_prob.dim() != 2:
        raise ValueError(f"{owner}: log_prob must be [B, T], got shape {tuple(log_prob.shape)}")
    for name, t in (("old_log_prob", old_log_prob), ("response_mask", response_mask)):
        if t.shape != log_prob.shape:
            raise ValueError(f"{owner}: {name} shape {tuple(t.shape)} does not match log_prob "
                             f"shape {tuple(log_prob.shape)}")
    if advantages.shape not in (log_prob.shape[:1], log_prob.shape):
        raise ValueError(f"{owner}: advantages shape {tuple(advantages.shape)} does not match log_prob "
                         f"shape {tuple(log_prob.shape)} (expected [B] or [B, T])")
    mask = response_mask.bool()
    maskf = mask.float()
    return Prepared(log_prob.float(), old_log_prob.float(), mask, maskf, maskf.sum(-1))


def token_log_ratio(p: Prepared) -> Tensor:
    """d_t = logp_new - logp_old on response tokens, exactly 0 on padding (NaN-safe), float32 [B, T]."""
    return torch.where(p.mask, p.log_prob - p.old_log_prob, 0.0)


def seq_advantage(advantages: Tensor, p: Prepared) -> Tensor:
    """[B] float32 advantage: as given if [B]; the masked token mean if [B, T] (0 where L = 0)."""
    a = advantages.float()
    if a.dim() == 1:
        return a
    return torch.where(p.mask, a, 0.0).sum(-1) / p.lengths.clamp(min=1.0)


def token_advantage(advantages: Tensor, p: Prepared) -> Tensor:
    """[B, T] float32 advantage: broadcast along T if given per sequence."""
    a = advantages.float()
    return a.unsqueeze(-1).expand_as(p.log_prob) if a.dim() == 1 else a


def ratio_clip(log_ratio: Tensor, adv: Tensor, low: float, high: float, clip_c: Optional[float],
               clamp: Tuple[Optional[float], Optional[float]] = (-MAX_LOG_RATIO, MAX_LOG_RATIO),
               ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """verl's `compute_policy_loss_vanilla`, elementwise: r = exp(clamp(log_ratio)), l = max(-A r, -A clip(r,
    1 - low, 1 + high)), and for A < 0 with a dual clip c: min(l, -A c). Returns (loss, upper, lower, dual,
    in_band) with verl's strict comparisons; in_band = 1 - low <= r <= 1 + high."""
    ratio = torch.exp(torch.clamp(log_ratio, min=clamp[0], max=clamp[1]))
    neg_adv = -adv
    l1 = neg_adv * ratio
    l2 = neg_adv * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    loss = torch.maximum(l1, l2)
    clipped = l2 > l1
    neg = adv < 0
    upper, lower = clipped & (adv > 0), clipped & neg
    rd = ratio.detach()
    in_band = (rd >= 1.0 - low) & (rd <= 1.0 + high)
    if clip_c is None:
        return loss, upper, lower, torch.zeros_like(upper), in_band
    l3 = neg_adv * clip_c
    dual = (loss > l3) & neg
    return torch.where(neg, torch.minimum(loss, l3), loss), upper, lower, dual, in_band


class RatioClipRule(ClipRule):
    """Base of the ratio-space rules: ``clip_ratio_low`` in [0, 1), ``clip_ratio_high`` >= 0, ``clip_ratio_c`` > 1
    or None (no dual clip)."""

    settings = ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c")
    settings_class: ClassVar[type] = RatioClipSettings  # the dataclass that checks them

    def __init__(self, clip_ratio_low: float, clip_ratio_high: float,
                 clip_ratio_c: Optional[float], **extra) -> None:
        super().__init__()
        self._take(self.settings_class(clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high,
                                       clip_ratio_c=clip_ratio_c, **extra, owner=type(self).__name__))


def seq_log_ratio_per_token(p: Prepared, seq_value: Tensor, ratio_grad: str, full: Tensor) -> Tensor:
    """[B, T] log of a sequence ratio per token (base.py): ``per_token`` sg(seq_value) + logp_t - sg(logp_t);
    ``length_weighted`` ``full`` (with its graph through S) on every token. 0 on padding."""
    if ratio_grad == "length_weighted":
        return full.unsqueeze(-1) * p.maskf
    lp = torch.where(p.mask, p.log_prob, 0.0)  # padding may hold -inf: keep grads finite
    return (lp - lp.detach() + seq_value.detach().unsqueeze(-1)) * p.maskf


def cap_mask(log_ratio: Tensor, adv: Tensor, binding: Tensor, low: Optional[float], high: Optional[float]
             ) -> Tensor:
    """Where clamping ``log_ratio`` to [low, high] (None: unbounded) alone zeroes the gradient: no clip binds and
    A != 0."""
    out = torch.zeros_like(binding)
    if high is not None:
        out |= log_ratio.detach() > high
    if low is not None:
        out |= log_ratio.detach() < low
    return out & ~binding & (adv != 0)


def token_ratio_inputs(owner: str, log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor,
                       response_mask: Tensor) -> Tuple[Prepared, Tensor, Tensor, Tensor]:
    """(`prepare`'s result, d_t, the [B, T] advantage, r_t = exp(clamp(d_t, -20, 20)))."""
    p = prepare(owner, log_prob, old_log_prob, advantages, response_mask)
    d = token_log_ratio(p)
    return p, d, token_advantage(advantages, p), torch.exp(d.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))


def weight_clip_result(token_loss: Tensor, d: Tensor, ratio: Tensor, in_band: Tensor, adv: Tensor,
                       p: Prepared) -> ClipResult:
    """Token-level `ClipResult` of a rule that bounds a token's gradient weight (CISPO, SAPO): binding where the
    ratio is out of ``in_band`` and A != 0, upper above r = 1, lower below; no dual, no cap."""
    r, zero = ratio.detach(), torch.zeros_like(p.mask)
    bind = ~in_band & p.mask & (adv != 0)
    return seq_result(token_loss, d.sum(-1), bind & (r > 1.0), bind & (r < 1.0), zero, in_band, zero, p)


def seq_result(token_loss: Tensor, seq_log_ratio: Tensor, upper: Tensor, lower: Tensor, dual: Tensor,
               in_band: Tensor, cap: Tensor, p: Prepared) -> ClipResult:
    """A `ClipResult` from the [B, T] loss and [B, T] decisions, or per-sequence [B] ones broadcast over tokens."""
    m = p.mask

    def on_tokens(x: Tensor) -> Tensor:
        return (x if x.dim() == 2 else x.unsqueeze(-1)) & m
    return ClipResult(token_loss=token_loss * p.maskf, seq_log_ratio=seq_log_ratio.detach(),
                      clip_upper=on_tokens(upper), clip_lower=on_tokens(lower), clip_dual=on_tokens(dual),
                      in_band=on_tokens(in_band), clip_cap=on_tokens(cap))
