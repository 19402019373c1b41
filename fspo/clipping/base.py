"""The clipping-rule contract: what every rule (FSPO, GRPO, RLOO, GSPO, ...) takes and returns.

Owns: `ClipRule` (a torch Module, so running statistics such as FSPO's EMA sigma are buffers that
land in checkpoints) and `ClipResult`. Leaves out: aggregation over tokens/sequences
(fspo/losses.py) and counting clip fractions by length (fspo/diagnostics).

A rule maps per-token log-probs to a per-token loss matrix (the negated PPO-style surrogate):

    token_loss[i, t] = -surrogate_{i,t}        (0 where response_mask is 0)

Sequence-level rules (FSPO, RLOO, GSPO) make their sequence ratio per token, verl's convention
for sequence-level ratios (its GSPO): log r_{i,t} = sg(log s_i) + logp_t - sg(logp_t). The value
of every token's term is the sequence's surrogate, and d token_loss[i, t] / d logp_{i,t} is the
sequence's surrogate derivative (-A_i s_i where no clip binds) on that token alone. So an
aggregation weight k_i per token (fspo/losses.py) gives every token of sequence i the gradient
-A_i s_i k_i: with "token-mean" (k_i = 1 / sum L) that is the paper's eq. obj-fspo / eq. rloo
(1/G per sequence, whatever L_i) up to the mini-batch constant G / sum L. FSPO and RLOO keep the
older broadcast form (the sequence surrogate with its full gradient through S on each of its L_i
tokens: under token-mean sequence i then pulls with L_i times the paper's weight) reachable as
``ratio_grad="length_weighted"``, for comparison only.

Binding masks: ``clip_upper/lower/dual[i, t]`` is True where the clipped branch is the one the
pessimistic min selects AND it differs from the unclipped branch (zero gradient through the ratio
there). For sequence-level rules the per-sequence decision is broadcast over the sequence's
tokens, so the per-sequence clip fraction ``(mask * m).sum(-1) / L`` is exactly 0 or 1.
All masks are False on padding.

Acceptance (paper section LRE): ``in_band[i, t]`` is True where the ratio lies inside the rule's
band, whatever the advantage's sign: FSPO lo_L <= S_i <= hi_L; RLOO 1 - low <= exp(S_i) <= 1 + high;
GSPO the same on exp(S_i / L_i); GRPO per token on exp(d_t). It is the event whose rate q(L) enters
the LRE; the binding masks above (which depend on sign(A) and count the dual clip) are what the
optimizer sees. ``clip_cap[i, t]`` marks terms whose gradient is zero only because the log-ratio
hit the float-safety cap (|log ratio| > 20, GSPO's > 10), with no clip of the rule binding.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Dict, Optional

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
    """Base class of clipping rules.

    Subclasses implement `forward(log_prob, old_log_prob, advantages, response_mask)`:
      - ``log_prob``, ``old_log_prob``: [B, T] (any float dtype; math is done in float32),
      - ``advantages``: [B] (one per sequence) or [B, T] (token-broadcast, verl layout),
      - ``response_mask``: [B, T], 1 on generated tokens,
    and return a `ClipResult`. They validate their settings in ``__init__`` and raise ValueError
    naming the setting.

    `observe` is called by the training step once per optimizer step with detached statistics of
    the mini-batch (for running estimates such as FSPO's EMA sigma); the default does nothing.
    `extra_metrics` returns scalars to log (e.g. ``clip/sigma_hat``).
    """

    level: ClassVar[str] = "token"  # "token" or "sequence"

    def forward(self, log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor,
                response_mask: Tensor) -> ClipResult:  # pragma: no cover - abstract
        raise NotImplementedError

    @torch.no_grad()
    def observe(self, seq_log_ratio: Tensor, lengths: Tensor, token_log_ratio: Tensor,
                response_mask: Tensor) -> None:
        """Update running statistics from one mini-batch (all tensors detached)."""

    def extra_metrics(self) -> Dict[str, float]:
        return {}

    def theory_clip_fraction(self, lengths, sigma: float):
        """Closed-form clip probability c(L) when S_L ~ N(0, sigma^2 L) (the paper's Gaussian model of S_L), as a
        numpy array over ``lengths``; None when the rule has no closed form (token-level rules)."""
        return None
