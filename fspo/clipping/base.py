"""The clipping-rule contract: `ClipRule` (a torch Module, so running statistics are checkpointed buffers) and
`ClipResult`. A rule maps per-token log-probs to token_loss[i, t] = -surrogate_{i,t} (0 on padding).

Sequence-level rules give every token the sequence's ratio in verl's form log r_{i,t} = sg(log s_i) + logp_t -
sg(logp_t): each token's value is the sequence's surrogate and its gradient -A_i s_i lands on that token alone,
so "token-mean" gives paper eq. (3) (FSPO) / eq. (8) (RLOO), 1/G per sequence whatever L_i, up to the
mini-batch constant G / sum L. ``ratio_grad="length_weighted"`` (FSPO, RLOO) keeps the full gradient through
S on each of the L_i tokens (L_i times the paper's weight under token-mean), for comparison only.

Masks (all False on padding; per-sequence decisions broadcast over the sequence's tokens):
``clip_upper/lower/dual`` where the pessimistic min selects a clipped branch that differs from the unclipped
one (zero gradient); ``in_band`` where the ratio lies inside the rule's band whatever sign(A): the paper's
acceptance event, whose rate q(L) enters the LRE; ``clip_cap`` where only the float-safety cap on the
log-ratio zeroes the gradient. The weighting rules (CISPO, SAPO, DPPO, CPPO, VESPO) take ``value``:
``surrogate`` (default) gives a token the value -A at the old policy like every rule, ``verl`` reports the
reference implementation's value; the gradient is the same. A soft weight has no band: its diagnostics count
a term as clipped where the weight has lost half (our reading; the loss does not depend on it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Dict, Optional, Tuple

import torch
from torch import Tensor


@dataclass
class ClipResult:
    """Output of a `ClipRule` call. Shapes: B sequences, T response positions."""

    token_loss: Tensor  # [B, T] float32, -surrogate per token, 0 on padding
    seq_log_ratio: Tensor  # [B] float32, detached: S_i = sum_t m_t (logp_new - logp_old)
    clip_upper: Tensor  # [B, T] bool
    clip_lower: Tensor  # [B, T] bool
    clip_dual: Tensor  # [B, T] bool
    in_band: Tensor  # [B, T] bool: the paper's acceptance event (ratio inside the band), any sign of A
    clip_cap: Optional[Tensor] = None  # [B, T] bool: zero gradient from the float-safety cap alone

    def __post_init__(self) -> None:
        if self.clip_cap is None:
            self.clip_cap = torch.zeros_like(self.clip_upper)

    @property
    def clipped(self) -> Tensor:
        """[B, T] bool: any binding clip (upper, lower or dual), the float-safety cap excluded."""
        return self.clip_upper | self.clip_lower | self.clip_dual


class ClipRule(torch.nn.Module):
    """Base class: ``forward(log_prob, old_log_prob [B, T] any float dtype, math in float32; advantages [B] or
    [B, T]; response_mask [B, T])`` -> `ClipResult`. Settings are validated in ``__init__`` (ValueError naming
    the setting). `observe` gets detached statistics once per optimizer step (running estimates);
    `extra_metrics` returns scalars to log."""

    level: ClassVar[str] = "token"  # "token" or "sequence"
    settings: ClassVar[Tuple[str, ...]] = ()  # the attributes `extra_repr` shows

    def forward(self, log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor,
                response_mask: Tensor) -> ClipResult:  # pragma: no cover - abstract
        raise NotImplementedError

    @torch.no_grad()
    def observe(self, seq_log_ratio: Tensor, lengths: Tensor, token_log_ratio: Tensor,
                response_mask: Tensor) -> None:
        """Update running statistics from one mini-batch (all tensors detached)."""

    def extra_metrics(self) -> Dict[str, float]:
        return {}

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={getattr(self, k)}" for k in self.settings)

    def _take(self, checked: Any) -> None:
        """Copy the `settings` attributes of ``checked`` (the rule's validated settings dataclass) onto the rule."""
        for k in self.settings:
            setattr(self, k, getattr(checked, k))

    def theory_clip_fraction(self, lengths, sigma: float):
        """Closed-form clip probability c(L) over ``lengths`` (numpy) when S_L ~ N(0, sigma^2 L); None when the rule
        has none (token-level rules)."""
        return None
