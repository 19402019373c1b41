"""The policy's forward passes over a rollout batch, for `RLModule`: micro-batch layouts and log-probs.

Layouts (``ppo.packing``, ``ppo.micro_batch_max_tokens``): packing on with segment attention (sdpa): one
unpadded row per micro-batch of at most the budget in real tokens; packing on with other attention: rows of a
common width, block-diagonal attention from restarting position ids; packing off: padded micro-batches of
sequences sorted by length. With several data-parallel ranks the lists are padded with ``None`` (a zero-weight
dummy forward) to the largest count on any rank: FSDP forward/backward are collectives.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from fspo.models.segment_attention import uses_segment_attention
from fspo.runtime.launch.distributed import dp_rank_size, sync_count
from fspo.types import RolloutBatch
from fspo.update.logprobs import response_log_probs
from fspo.update.microbatches import token_budget_micro_batches
from fspo.update.packing import TokenUsage, packed_micro_batches, row_width, segment_micro_batches


def micro_batches(module, batch: RolloutBatch) -> Tuple[List[Optional[torch.Tensor]], Optional[int]]:
    """(index groups, ``pack_width`` for `log_probs`: None padded, else the row width; 0 one row)."""
    ppo = module.ppo
    total = (batch.prompt_mask.sum(-1) + batch.lengths).cpu()
    budget = ppo.micro_batch_max_tokens
    if ppo.packing and uses_segment_attention(module.policy):
        groups, width = segment_micro_batches(total, budget), 0
    elif ppo.packing:
        width = row_width(total, budget, ppo.pack_row_factor)  # packs at up to 5 widths: once
        groups = packed_micro_batches(total, budget, width=width)
    else:
        groups, width = token_budget_micro_batches(total, budget), None
    if dp_rank_size(module)[1] > 1:
        groups = groups + [None] * (sync_count(len(groups), module.device) - len(groups))
    return groups, width


def dummy_micro_batch(batch: RolloutBatch) -> RolloutBatch:
    """What a rank with fewer micro-batches runs (weight 0): the batch's shortest sequence, trimmed."""
    shortest = torch.argmin(batch.prompt_mask.sum(-1) + batch.lengths).reshape(1)
    return batch.select(shortest).trim()


def log_probs(module, batch: RolloutBatch, with_entropy: bool = False, pack_width: Optional[int] = None,
              usage: Optional[TokenUsage] = None):
    """(logp [B, T], entropy or None) at ``ppo.logprob_temperature``, under bf16 autocast with
    ``ppo.autocast=bf16``; a +-inf log-prob becomes NaN, so the non-finite check skips the update (a clip rule
    could clip it to a finite loss, yet it would poison the EMA sigma and the diagnostics)."""
    bf16 = module.ppo.autocast == "bf16"  # parameters stay fp32; backward runs outside autocast
    with torch.autocast(device_type=batch.response_ids.device.type, dtype=torch.bfloat16, enabled=bf16):
        logp, ent = response_log_probs(module.policy, batch, module.ppo.logprob_temperature, with_entropy,
                                       pack_width=pack_width, usage=usage,
                                       head_chunk_rows=int(module.ppo.lm_head_chunk_rows))
    return torch.where(torch.isinf(logp), torch.full_like(logp, float("nan")), logp), ent


@torch.no_grad()
def old_log_probs(module, batch: RolloutBatch, usage: Optional[TokenUsage] = None,
                  skip: Optional[torch.Tensor] = None) -> torch.Tensor:
    """log pi_old for every response token, micro-batched, float32 [B, T]; rows in ``skip``
    (indices) are not computed and hold NaN (their old log-probs come from the loss pass)."""
    device = batch.response_ids.device
    out = torch.zeros(batch.response_ids.shape, dtype=torch.float32, device=device)
    rows = torch.arange(batch.batch_size, device=device)
    if skip is not None and skip.numel():
        out[skip.to(device)] = float("nan")
        keep = torch.ones(batch.batch_size, dtype=torch.bool, device=device)
        keep[skip.to(device)] = False
        rows = rows[keep]
    sub = batch.select(rows) if rows.numel() < batch.batch_size else batch
    groups, width = micro_batches(module, sub) if rows.numel() else ([], None)
    if rows.numel() == 0 and dp_rank_size(module)[1] > 1:  # this rank has nothing, others may
        groups = [None] * sync_count(0, module.device)
    for idx in groups:
        if idx is None:  # dummy forward: FSDP forwards are collectives
            log_probs(module, dummy_micro_batch(batch), pack_width=width)
            continue
        lp, _ = log_probs(module, sub.select(idx).trim(), pack_width=width, usage=usage)
        out[rows[idx.to(device)], :lp.shape[1]] = lp
    return out
