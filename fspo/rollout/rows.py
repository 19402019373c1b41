"""Padding token lists, and rows of generated samples -> `RolloutBatch` (the vLLM engine's packing)."""
from __future__ import annotations

from typing import List, Sequence

import torch
from torch import Tensor

from fspo.types import RolloutBatch


def pad_id(tokenizer, model) -> int:
    """The tokenizer's pad id, else its EOS id, else the model config's pad id, else 0."""
    for v in (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None),
              getattr(getattr(model, "config", None), "pad_token_id", None)):
        if v is not None:
            return int(v)
    return 0


def left_pad(seqs: Sequence[List[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Left-pad token lists into (ids [B, P], mask [B, P])."""
    p = max((len(s) for s in seqs), default=0)
    ids = torch.full((len(seqs), p), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), p), dtype=torch.long)
    for i, s in enumerate(seqs):
        if len(s):
            ids[i, p - len(s):] = torch.tensor(s, dtype=torch.long)
            mask[i, p - len(s):] = 1
    return ids, mask


def to_rollout_batch(rows, pad_token_id: int) -> RolloutBatch:
    """Pack ``(group_id, prompt_ids, response_ids, response_logprobs, overlong)`` rows: prompts left-padded,
    responses right-padded, response_mask 1 on every generated token, engine_log_probs 0 on padding."""
    b = len(rows)
    t_len = max((len(r[2]) for r in rows), default=0)
    prompt_ids, prompt_mask = left_pad([r[1] for r in rows], pad_token_id)
    response_ids = torch.full((b, t_len), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros((b, t_len), dtype=torch.long)
    logps = torch.zeros((b, t_len), dtype=torch.float32)
    for i, (_, _, r, lp, _) in enumerate(rows):
        if r:
            response_ids[i, :len(r)] = torch.tensor(r)
            response_mask[i, :len(r)] = 1
        if lp:
            logps[i, :len(lp)] = torch.tensor(lp, dtype=torch.float32)
    return RolloutBatch(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
        response_mask=response_mask, group_ids=torch.tensor([r[0] for r in rows], dtype=torch.long),
        overlong=torch.tensor([r[4] for r in rows], dtype=torch.bool), engine_log_probs=logps,
    ).validate()
