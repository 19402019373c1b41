"""Sampling loop for `HFEngine` that drops finished sequences from the batch as it decodes.

A row leaves the batch and the KV cache at its EOS, so decoding costs about the sum of the real lengths (not
B x the longest, as ``model.generate``), and each distinct prompt is prefilled once. Same distribution as
``generate`` (EOS masked below ``min_new_tokens``, temperature, top-k, top-p, multinomial; greedy at temperature
0; the model's ``generation_config`` not applied), though its random stream differs once a row has finished.
Returns [B, max_new_tokens] token ids (``pad_id`` after each row's first EOS) and the engine log-probs

    log_probs[i, t] = log softmax(logits[i, t])[tokens[i, t]]     (temperature 1, no processor)

``synced`` (FSDP): every rank runs the same number of forwards, and a stop signal ends the decoding on every rank
at the same token (`StepInterrupted`).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from transformers import DynamicCache
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from fspo.rollout.base import SamplingConfig
from fspo.runtime.checkpoints.stop_signal import StepInterrupted, synced_stop_wanted


def logits_pipeline(params: SamplingConfig, prompt_len: int, eos_id: int) -> LogitsProcessorList:
    """The processors ``generate`` applies for ``params``, in its order."""
    procs = LogitsProcessorList()
    if params.min_new_tokens:
        procs.append(MinNewTokensLengthLogitsProcessor(prompt_len, params.min_new_tokens, eos_id))
    if params.temperature > 0:
        if params.temperature != 1.0:
            procs.append(TemperatureLogitsWarper(params.temperature))
        if params.top_k > 0:
            procs.append(TopKLogitsWarper(params.top_k))
        if params.top_p < 1.0:
            procs.append(TopPLogitsWarper(params.top_p))
    return procs


class Decoded(NamedTuple):
    """``tokens`` and ``log_probs`` (float32, 0 after the row's end), [B, T] (module docstring)."""

    tokens: torch.Tensor
    log_probs: torch.Tensor


def _any_running(running: torch.Tensor, synced: bool) -> bool:
    """Whether any row still runs: this rank's, or with ``synced`` any rank's (an all-reduce)."""
    if not synced:
        return bool(running.any())
    flag = torch.tensor([float(bool(running.any())), float(synced_stop_wanted())], device=running.device)
    torch.distributed.all_reduce(flag)  # with a stop vote: a stop signal during a training rollout
    if flag[1].item() > 0:  # every rank sees the same sum: all leave at this token
        raise StepInterrupted("stop signal during a synced generation")
    return bool(flag[0].item() > 0)


@torch.no_grad()
def decode_compact(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, params: SamplingConfig,
                   eos_id: int, pad_id: int, synced: bool = False) -> Decoded:
    """Sample up to ``params.max_new_tokens`` tokens per row; finished rows leave the batch. ``synced``: forwards
    continue until no row of any rank runs, a finished rank keeping one idle row (as ``synced_gpus=True``)."""
    B, P = input_ids.shape
    T = int(params.max_new_tokens)
    device = input_ids.device
    out = torch.full((B, T), pad_id, dtype=torch.long, device=device)
    out_lp = torch.zeros((B, T), dtype=torch.float32, device=device)
    if (B == 0 and not synced) or T == 0:
        return Decoded(out, out_lp)
    if B == 0:
        raise ValueError("decode_compact(synced=True) needs at least one row on every rank")
    procs = logits_pipeline(params, P, eos_id)
    sample = params.temperature > 0
    mask = attention_mask.long()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache()
    # prefill each distinct prompt once (the G samples of a prompt share it), then copy its KV cache
    rows = torch.cat([input_ids, mask], 1)
    uniq, inverse = torch.unique(rows, dim=0, return_inverse=True)
    if uniq.shape[0] == B:  # no prompt repeats: keep the batch order
        uniq, inverse = rows, None
    u_mask = uniq[:, P:]
    logits = model(input_ids=uniq[:, :P], attention_mask=u_mask, position_ids=(u_mask.cumsum(-1) - 1).clamp(min=0),
                   past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1].float()
    if inverse is not None:
        logits = logits[inverse]
        cache.batch_select_indices(inverse)
    seq = input_ids                        # prompt + tokens so far, for the length-aware processors
    pos = positions[:, -1:] + 1            # next position of each running row
    alive = torch.arange(B, device=device)  # original row of each row in the batch
    done = torch.zeros(B, dtype=torch.bool, device=device)  # idle rows (synced only)
    for t in range(T):
        scores = procs(seq, logits)
        tok = torch.multinomial(torch.softmax(scores, -1), 1).squeeze(1) if sample else scores.argmax(-1)
        lp = torch.log_softmax(logits, -1).gather(1, tok[:, None]).squeeze(1)
        live = ~done
        out[alive[live], t] = tok[live]
        out_lp[alive[live], t] = lp[live]
        running = live & (tok != eos_id)
        if t == T - 1 or not _any_running(running, synced):
            break
        if not bool(running.all()):  # finished rows leave the batch and the KV cache
            keep = running.nonzero().squeeze(1)
            if keep.numel() == 0:  # synced, and other ranks still run: keep one idle row
                keep = torch.zeros(1, dtype=torch.long, device=device)
            alive, tok, seq, mask, pos = alive[keep], tok[keep], seq[keep], mask[keep], pos[keep]
            done = ~running[keep]
            cache.batch_select_indices(keep)
        seq = torch.cat([seq, tok[:, None]], 1)
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)
        logits = model(input_ids=tok[:, None], attention_mask=mask, position_ids=pos, past_key_values=cache,
                       use_cache=True).logits[:, -1].float()
        pos = pos + 1
    return Decoded(out, out_lp)
