"""`RolloutBatch`: the one structure that crosses from generation to training (B sequences, P prompt and T
response positions), checked by `RolloutBatch.validate`:

- ``prompt_ids`` / ``prompt_mask``     Long [B, P]  LEFT-padded with ``pad_token_id``; mask 1 on real tokens.
- ``response_ids`` / ``response_mask`` Long [B, T]  RIGHT-padded; mask 1 on generated tokens (EOS included);
  L_i = ``response_mask[i].sum()``, 0 legal.
- ``old_log_probs``  float32 [B, T]  log pi_old(y_t | h_t), recomputed or the engine's (``ppo.old_log_probs``);
  0 on padding.
- ``advantages``, ``rewards``  float [B];  ``group_ids`` Long [B] (a prompt's G completions share one and stay
  in one batch);  ``overlong`` Bool [B] (stopped at max_new_tokens without EOS).
- ``engine_log_probs``  optional float32 [B, T]: the engine's log-probs of the sampled tokens at temperature 1,
  0 on padding (the train-inference gap).
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Callable, Optional

import torch
from torch import Tensor


@dataclass
class RolloutBatch:
    """One step's rollouts (module docstring)."""

    prompt_ids: Tensor
    prompt_mask: Tensor
    response_ids: Tensor
    response_mask: Tensor
    old_log_probs: Optional[Tensor] = None
    advantages: Optional[Tensor] = None
    rewards: Optional[Tensor] = None
    group_ids: Optional[Tensor] = None
    overlong: Optional[Tensor] = None
    engine_log_probs: Optional[Tensor] = None

    @property
    def batch_size(self) -> int:
        return int(self.response_ids.shape[0])

    @property
    def lengths(self) -> Tensor:
        """L_i = sum_t response_mask[i, t], LongTensor [B]."""
        return self.response_mask.sum(-1).long()

    def input_ids(self) -> Tensor:
        """Prompt and response concatenated, [B, P + T]."""
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    def attention_mask(self) -> Tensor:
        """1 on real prompt and response tokens, [B, P + T]."""
        return torch.cat([self.prompt_mask, self.response_mask], dim=1).long()

    def validate(self) -> "RolloutBatch":
        """Check shapes and mask polarity; raise ValueError naming the field that is wrong."""
        b = self.batch_size
        for f, ref in (("prompt_mask", "prompt_ids"), ("response_mask", "response_ids"),
                       ("old_log_probs", "response_ids"), ("engine_log_probs", "response_ids")):
            v, r = getattr(self, f), getattr(self, ref)
            if v is not None and v.shape != r.shape:
                raise ValueError(f"RolloutBatch.{f} shape {tuple(v.shape)} != {ref} shape {tuple(r.shape)}")
        if self.prompt_ids.shape[0] != b:
            raise ValueError(f"RolloutBatch.prompt_ids has {self.prompt_ids.shape[0]} rows, expected {b}")
        for f in ("advantages", "rewards", "group_ids", "overlong"):
            v = getattr(self, f)
            if v is not None and tuple(v.shape) != (b,):
                raise ValueError(f"RolloutBatch.{f} must have shape ({b},), got {tuple(v.shape)}")
        m = self.response_mask
        if m.numel() and ((m != 0) & (m != 1)).any():
            raise ValueError("RolloutBatch.response_mask must hold only 0 and 1")
        # right padding: a 1 never follows a 0 within a row
        if m.shape[1] > 1 and (m[:, 1:] > m[:, :-1]).any():
            raise ValueError("RolloutBatch.response_mask must be right-padded (1s then 0s per row)")
        return self

    def _map(self, fn: Callable[[Tensor], Tensor]) -> "RolloutBatch":
        """Every tensor field through ``fn``, the rest as is."""
        kw = {f.name: getattr(self, f.name) for f in fields(self)}
        return RolloutBatch(**{k: fn(v) if isinstance(v, Tensor) else v for k, v in kw.items()})

    def select(self, index: Tensor) -> "RolloutBatch":
        """Rows ``index`` of every tensor field (a mini-batch or micro-batch view)."""
        return self._map(lambda v: v[index])

    def trim(self) -> "RolloutBatch":
        """Drop all-padding columns: prompt columns on the left, response columns on the right."""
        p_keep = int(self.prompt_mask.sum(-1).max().item()) if self.batch_size else 0
        t_keep = int(self.lengths.max().item()) if self.batch_size else 0
        p0 = self.prompt_ids.shape[1] - p_keep
        kw = {f: getattr(self, f)[:, p0:] for f in ("prompt_ids", "prompt_mask")}
        for f in ("response_ids", "response_mask", "old_log_probs", "engine_log_probs"):
            if getattr(self, f) is not None:
                kw[f] = getattr(self, f)[:, :t_keep]
        return replace(self, **kw)

    def to(self, device) -> "RolloutBatch":
        return self._map(lambda v: v.to(device))
