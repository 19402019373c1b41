"""Shared pieces of the clipping rules: input checks, masked sums, verl-style ratio-space clipping.

Owns: argument validation helpers (one ValueError naming the setting), `prepare` (shape checks and
the float32 upcast every rule does first), per-sequence/per-token advantage layouts, the verl
ratio-space clip `ratio_clip` (GRPO, RLOO and GSPO share it) and `RatioClipRule`, the base of the
three ratio-space rules, the two gradient forms of a sequence ratio (`seq_log_ratio_per_token`),
the float-safety cap mask and `seq_result`; for the weight-clipping token rules (CISPO, SAPO)
`token_ratio_inputs`, `weight_clip_result` and `VALUE_FORMS`. Leaves out: the log-space FSPO band
(fspo.py) and aggregation (losses.py).
"""
from __future__ import annotations

from typing import Dict, NamedTuple, Optional, Tuple

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

#: verl clamps token log-ratios to [-20, 20] before exp; we use the same bound as the float-safety
#: cap everywhere (exp(20) = 4.85e8, far from float32 overflow even after summing 4M tokens).
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
    """Check shapes (ValueError naming both shapes on mismatch) and upcast to float32.

    ``log_prob``, ``old_log_prob`` and ``response_mask`` must all be [B, T]; ``advantages`` is [B]
    or [B, T]. Any float dtype is accepted (bf16 included); all math downstream is float32.
    """
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
    """verl's `compute_policy_loss_vanilla` surrogate, elementwise on any shape.

    r = exp(clamp(log_ratio)); l1 = -A r; l2 = -A clip(r, 1 - low, 1 + high); l = max(l1, l2);
    where A < 0 and a dual clip c is set: l = min(l, -A c).
    Returns (loss, upper, lower, dual, in_band): upper = (l2 > l1) & (A > 0), lower = (l2 > l1) &
    (A < 0), dual = (l > -A c) & (A < 0) - the same strict comparisons verl uses for its clip
    fractions; in_band = 1 - low <= r <= 1 + high (the paper's acceptance event, any sign of A).
    """
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
    """Base of the ratio-space rules (GRPO, RLOO, GSPO): verl's settings and their validation.

    ``clip_ratio_low`` in [0, 1) (the ratio floor 1 - low must stay positive), ``clip_ratio_high``
    >= 0, ``clip_ratio_c`` > 1 or None (dual clip off).
    """

    def __init__(self, clip_ratio_low: float, clip_ratio_high: float,
                 clip_ratio_c: Optional[float]) -> None:
        super().__init__()
        st = RatioClipSettings(clip_ratio_low, clip_ratio_high, clip_ratio_c, owner=type(self).__name__)
        self.clip_ratio_low, self.clip_ratio_high = st.clip_ratio_low, st.clip_ratio_high
        self.clip_ratio_c = st.clip_ratio_c

    def extra_repr(self) -> str:
        return (f"clip_ratio_low={self.clip_ratio_low}, clip_ratio_high={self.clip_ratio_high}, "
                f"clip_ratio_c={self.clip_ratio_c}")

    def extra_metrics(self) -> Dict[str, float]:
        return {}




def seq_log_ratio_per_token(p: Prepared, seq_value: Tensor, ratio_grad: str, full: Tensor) -> Tensor:
    """[B, T] float32 per-token log of a sequence-level ratio, in one of two gradient forms.

    ``per_token`` (verl's convention for sequence ratios, its GSPO): sg(seq_value_i) + logp_t -
    sg(logp_t): value seq_value_i on every token, d/dlogp_t = 1 on that token alone, so an
    aggregation weight k_i per token gives each token of sequence i the gradient A_i s_i k_i.
    ``length_weighted``: ``full`` (seq_value with its graph through S_i) on every token: d/dlogp_t
    = dS_i/dlogp_t summed over the sequence's L_i copies, i.e. L_i times the per-token form under
    token-mean (the form this project used before; kept for comparison only). Padding holds 0.
    """
    if ratio_grad == "length_weighted":
        return full.unsqueeze(-1) * p.maskf
    lp = torch.where(p.mask, p.log_prob, 0.0)  # padding may hold -inf: keep grads finite
    return (lp - lp.detach() + seq_value.detach().unsqueeze(-1)) * p.maskf


def cap_mask(log_ratio: Tensor, adv: Tensor, binding: Tensor, low: Optional[float], high: Optional[float]
             ) -> Tensor:
    """Where a float-safety clamp of ``log_ratio`` to [low, high] (None: unbounded) zeroes the
    gradient and no clip of the rule binds (A != 0; a zero advantage has no gradient anyway)."""
    out = torch.zeros_like(binding)
    if high is not None:
        out |= log_ratio.detach() > high
    if low is not None:
        out |= log_ratio.detach() < low
    return out & ~binding & (adv != 0)




def token_ratio_inputs(owner: str, log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor,
                       response_mask: Tensor) -> Tuple[Prepared, Tensor, Tensor, Tensor]:
    """(`prepare`'s result, d_t, the [B, T] advantage, r_t = exp(clamp(d_t, -20, 20))): verl's token
    ratio, as CISPO and SAPO start."""
    p = prepare(owner, log_prob, old_log_prob, advantages, response_mask)
    d = token_log_ratio(p)
    return p, d, token_advantage(advantages, p), torch.exp(d.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))


def weight_clip_result(token_loss: Tensor, d: Tensor, ratio: Tensor, in_band: Tensor, adv: Tensor,
                       p: Prepared) -> ClipResult:
    """A token-level `ClipResult` for rules whose clip bounds a token's gradient weight instead of
    zeroing it (CISPO, SAPO): binding where the ratio is out of ``in_band`` and A != 0, ``clip_upper``
    above r = 1, ``clip_lower`` below; no dual clip, no cap. All masks False on padding."""
    r = ratio.detach()
    bind = ~in_band & p.mask & (adv != 0)
    return ClipResult(token_loss=token_loss * p.maskf, seq_log_ratio=d.detach().sum(-1),
                      clip_upper=bind & (r > 1.0), clip_lower=bind & (r < 1.0),
                      clip_dual=torch.zeros_like(p.mask), in_band=in_band & p.mask)


def seq_result(token_loss: Tensor, seq_log_ratio: Tensor, upper: Tensor, lower: Tensor, dual: Tensor,
               in_band: Tensor, cap: Tensor, p: Prepared) -> ClipResult:
    """A `ClipResult` from the per-token loss [B, T] and per-sequence decisions [B] broadcast over
    each sequence's tokens (all masks False on padding)."""
    m = p.mask
    return ClipResult(
        token_loss=token_loss * p.maskf,
        seq_log_ratio=seq_log_ratio.detach(),
        clip_upper=upper.unsqueeze(-1) & m,
        clip_lower=lower.unsqueeze(-1) & m,
        clip_dual=dual.unsqueeze(-1) & m,
        in_band=in_band.unsqueeze(-1) & m,
        clip_cap=cap.unsqueeze(-1) & m,
    )
