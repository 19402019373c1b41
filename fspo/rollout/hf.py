"""Hugging Face rollout engine on the trainer's own policy module (so `sync_weights` is a no-op): the CPU default.
Prompts are left-padded and expanded to ``n`` samples; the response mask runs up to and including the first EOS
(none: ``overlong``); sampling is seeded per call inside a forked RNG. ``compact: true`` decodes with
`decode_compact` and reports ``engine_log_probs``; ``compact: false`` calls ``model.generate``. Under FSDP
decoding runs synced, every rank calling `generate` with the same number of sequences.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch
from torch import Tensor

from fspo.rollout.base import RolloutEngine, SamplingConfig
from fspo.rollout.decode import decode_compact
from fspo.rollout.rows import left_pad
from fspo.runtime.launch.distributed import is_sharded
from fspo.types import RolloutBatch


def completion_mask(response_ids: Tensor, eos_token_id: int) -> tuple[Tensor, Tensor]:
    """(mask, overlong): mask[i, t] = 1 iff no EOS occurs in response_ids[i, :t]; overlong[i] = no EOS at all."""
    is_eos = response_ids == eos_token_id
    before = torch.cumsum(is_eos.long(), dim=1) - is_eos.long()  # EOS count strictly before t
    mask = (before == 0).long()
    return mask, ~is_eos.any(dim=1)


def context_advice(longest: int, max_new_tokens: int, context: int) -> str:
    """The error for a prompt of ``longest`` tokens + ``max_new_tokens`` above the model's ``context``, with
    values that fit."""
    head = (f"prompt length {longest} + rollout.sampling.max_new_tokens {max_new_tokens} exceeds the model's "
            f"context (max_position_embeddings) of {context} tokens: ")
    if context - longest >= 1:
        return head + (f"set rollout.sampling.max_new_tokens={context - longest} (or less), or keep "
                       f"{max_new_tokens} new tokens and remove prompts over {max(context - max_new_tokens, 0)} "
                       f"tokens from the data")
    return head + (f"the prompt alone does not fit: remove prompts over {max(context - max_new_tokens, 1)} tokens "
                   f"from the data, or use a model with a longer context")


class HFEngine(RolloutEngine):
    """Engine on the policy module; ``batch_size`` caps sequences per decode call, ``compact`` drops finished
    rows while decoding, ``autocast="bf16"`` decodes under bf16 autocast (its log-probs are not the trainer's)."""

    def __init__(self, batch_size: int = 256, compact: bool = True, autocast: Optional[str] = None):
        if batch_size < 1:
            raise ValueError(f"rollout.engine.batch_size must be >= 1, got {batch_size}")
        if autocast not in (None, "bf16"):
            raise ValueError(f"rollout.engine.autocast must be null or 'bf16', got {autocast!r}")
        self.batch_size = batch_size
        self.compact = compact
        self.autocast = autocast

    @torch.no_grad()
    def generate(self, prompt_token_ids: Sequence[List[int]], params: SamplingConfig) -> RolloutBatch:
        tok, model = self.tokenizer, self.model
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        max_pos = getattr(model.config, "max_position_embeddings", None)
        longest = max((len(p) for p in prompt_token_ids), default=0)
        if max_pos is not None and longest + params.max_new_tokens > max_pos:
            raise ValueError(context_advice(longest, params.max_new_tokens, max_pos))
        expanded = [p for p in prompt_token_ids for _ in range(params.n)]
        device = next(model.parameters()).device
        synced = is_sharded(model) and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
        was_training = model.training
        model.eval()
        chunks = []
        try:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
                    torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=self.autocast == "bf16"):
                if params.seed is not None:
                    torch.manual_seed(params.seed)
                for s in range(0, len(expanded), self.batch_size):
                    ids, mask = left_pad(expanded[s:s + self.batch_size], pad_id)
                    if self.compact:
                        dec = decode_compact(model, ids.to(device), mask.to(device), params,
                                             tok.eos_token_id, pad_id, synced=synced)
                        chunks.append((ids, mask, dec.tokens.cpu(), dec.log_probs.cpu()))
                        continue
                    out = model.generate(
                        input_ids=ids.to(device), attention_mask=mask.to(device),
                        max_new_tokens=params.max_new_tokens, min_new_tokens=params.min_new_tokens or None,
                        do_sample=params.temperature > 0,
                        temperature=params.temperature if params.temperature > 0 else None,
                        top_p=params.top_p if params.temperature > 0 else None,
                        top_k=params.top_k if params.top_k > 0 and params.temperature > 0 else None,
                        pad_token_id=pad_id, eos_token_id=tok.eos_token_id, use_cache=True,
                        synced_gpus=synced)
                    chunks.append((ids, mask, out[:, ids.shape[1]:].cpu(), None))
        finally:
            model.train(was_training)
        return self._assemble(chunks, len(prompt_token_ids), params, pad_id)

    def _assemble(self, chunks, n_prompts: int, params: SamplingConfig, pad_id: int) -> RolloutBatch:
        p = max(c[0].shape[1] for c in chunks)
        t = max(c[2].shape[1] for c in chunks)
        P, PM, R, LP = [], [], [], []
        for ids, mask, resp, lp in chunks:
            P.append(torch.nn.functional.pad(ids, (p - ids.shape[1], 0), value=pad_id))
            PM.append(torch.nn.functional.pad(mask, (p - mask.shape[1], 0), value=0))
            R.append(torch.nn.functional.pad(resp, (0, t - resp.shape[1]), value=pad_id))
            if lp is not None:
                LP.append(torch.nn.functional.pad(lp, (0, t - lp.shape[1]), value=0.0))
        resp = torch.cat(R)
        rmask, overlong = completion_mask(resp, self.tokenizer.eos_token_id)
        resp = torch.where(rmask.bool(), resp, torch.full_like(resp, pad_id))
        engine_lp = torch.cat(LP) * rmask if len(LP) == len(chunks) else None
        group_ids = torch.arange(n_prompts).repeat_interleave(params.n)
        return RolloutBatch(prompt_ids=torch.cat(P), prompt_mask=torch.cat(PM), response_ids=resp,
                            response_mask=rmask, group_ids=group_ids, overlong=overlong,
                            engine_log_probs=engine_lp).trim()
