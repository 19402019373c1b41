"""Per-token log-probabilities of sampled responses under a causal LM.

Owns: `response_log_probs`, the one forward pass the trainer uses both for old log-probs and
for the policy loss (so both sides of the ratio come from the same computation).

    logp[i, t] = log softmax(logits[i, P - 1 + t] / temperature)[response_ids[i, t]]

computed in float32 whatever the model's dtype, 0 where ``response_mask`` is 0. Position ids
are ``cumsum(attention_mask) - 1`` so left padding does not shift positions, as in generation.
Optionally returns the per-token entropy of the same distribution (no gradient).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from fspo.types import RolloutBatch


def response_log_probs(model, batch: RolloutBatch, temperature: float = 1.0,
                       with_entropy: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
    """(logp [B, T] float32, entropy [B, T] float32 or None) for ``batch``'s responses."""
    input_ids = batch.input_ids()
    attn = batch.attention_mask()
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
    p, t = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
    logits = model(input_ids=input_ids, attention_mask=attn, position_ids=position_ids,
                   use_cache=False).logits
    logits = logits[:, p - 1:p + t - 1].float()
    if temperature != 1.0:
        logits = logits / temperature
    logz = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1) - logz
    mask = batch.response_mask.to(logp.dtype)
    logp = logp * mask
    ent = None
    if with_entropy:
        with torch.no_grad():
            probs = torch.softmax(logits, dim=-1)
            ent = (logz - (probs * logits).sum(-1)) * mask
    return logp, ent
