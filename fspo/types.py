"""The rollout batch contract shared by the rollout engines, the callback and the module.

Owns: `RolloutBatch`, the one structure that crosses from generation to training, with every
tensor's shape, dtype and mask polarity stated here and checked by `RolloutBatch.validate`.
Leaves out: how the batch is produced (fspo/rollout, fspo/rollout/callback.py) and consumed
(fspo/update/module.py).

Layout (B sequences, P prompt positions, T response positions):

- ``prompt_ids``    LongTensor [B, P]  prompt tokens, LEFT-padded with ``pad_token_id``.
- ``prompt_mask``   LongTensor [B, P]  1 on real prompt tokens, 0 on left padding.
- ``response_ids``  LongTensor [B, T]  generated tokens, RIGHT-padded with ``pad_token_id``.
- ``response_mask`` LongTensor [B, T]  1 on generated tokens (the EOS token included), 0 on padding.
  The length of completion i is ``L_i = response_mask[i].sum()``; L_i = 0 is legal.
- ``old_log_probs`` FloatTensor [B, T] float32 log pi_old(y_t | h_t): the trainer's own forward
  pass (``ppo.old_log_probs=recompute``) or the engine's log-probs (``=engine``); 0 where
  ``response_mask`` is 0.
- ``advantages``    FloatTensor [B]    one scalar advantage per completion.
- ``rewards``       FloatTensor [B]    scalar reward per completion.
- ``group_ids``     LongTensor [B]     index of the prompt a completion answers; the G completions of
  a prompt share a group id and always live in the same batch (whole groups).
- ``overlong``      BoolTensor [B]     True where generation stopped at max_new_tokens without EOS.
- ``engine_log_probs`` optional FloatTensor [B, T] float32 log-probs of the sampled tokens reported by
  the rollout engine, at temperature 1 (raw logits; vLLM's and HFEngine's compact decoder's), 0 on
  padding: the train-inference gap diagnostic, and the old log-probs under ``ppo.old_log_probs=engine``.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Optional

import torch
from torch import Tensor


@dataclass
class RolloutBatch:
    """One step's rollouts; see the module docstring for shapes and mask polarity."""

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
        if self.prompt_ids.shape != self.prompt_mask.shape:
            raise ValueError(
                f"RolloutBatch.prompt_mask shape {tuple(self.prompt_mask.shape)} != prompt_ids "
                f"shape {tuple(self.prompt_ids.shape)}"
            )
        if self.response_ids.shape != self.response_mask.shape:
            raise ValueError(
                f"RolloutBatch.response_mask shape {tuple(self.response_mask.shape)} != response_ids "
                f"shape {tuple(self.response_ids.shape)}"
            )
        if self.prompt_ids.shape[0] != b:
            raise ValueError(f"RolloutBatch.prompt_ids has {self.prompt_ids.shape[0]} rows, expected {b}")
        for f in ("old_log_probs", "engine_log_probs"):
            v = getattr(self, f)
            if v is not None and v.shape != self.response_ids.shape:
                raise ValueError(
                    f"RolloutBatch.{f} shape {tuple(v.shape)} != response_ids shape "
                    f"{tuple(self.response_ids.shape)}"
                )
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

    def select(self, index: Tensor) -> "RolloutBatch":
        """Rows ``index`` of every tensor field (a mini-batch or micro-batch view)."""
        kw = {}
        for f in fields(self):
            v = getattr(self, f.name)
            kw[f.name] = v[index] if isinstance(v, Tensor) else v
        return RolloutBatch(**kw)

    def trim(self) -> "RolloutBatch":
        """Drop all-padding columns: prompt columns on the left, response columns on the right."""
        p_keep = int(self.prompt_mask.sum(-1).max().item()) if self.batch_size else 0
        t_keep = int(self.lengths.max().item()) if self.batch_size else 0
        p0 = self.prompt_ids.shape[1] - p_keep
        kw = dict(
            prompt_ids=self.prompt_ids[:, p0:],
            prompt_mask=self.prompt_mask[:, p0:],
            response_ids=self.response_ids[:, :t_keep],
            response_mask=self.response_mask[:, :t_keep],
        )
        for f in ("old_log_probs", "engine_log_probs"):
            v = getattr(self, f)
            if v is not None:
                kw[f] = v[:, :t_keep]
        return replace(self, **kw)

    def to(self, device) -> "RolloutBatch":
        kw = {}
        for f in fields(self):
            v = getattr(self, f.name)
            kw[f.name] = v.to(device) if isinstance(v, Tensor) else v
        return RolloutBatch(**kw)
