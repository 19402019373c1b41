"""Attention for packed sequences without a mask: causal attention inside each sequence of one unpadded row,

    out[s:e] = softmax(q[s:e] k[s:e]^T * scale + causal) v[s:e]      for every sequence [s, e)

with sdpa's causal kernel, consecutive sequences of equal length batched on a strided view (a masked row would
cost the full row x row attention). `enable_segment_attention` switches an ``sdpa`` model without sliding windows
to it; without the ``fspo_segments`` keyword it IS Hugging Face's sdpa attention. The packed pass passes
``fspo_segments`` and a placeholder 4D ``attention_mask`` so that transformers builds no mask.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

SEGMENT_ATTENTION = "fspo_segments"
Run = Tuple[int, int, int]  # (start, count, length): `count` sequences of `length` tokens from `start`


def segment_runs(lengths: Sequence[int]) -> List[Run]:
    """Sequences laid out back to back in this order -> runs of consecutive equal lengths."""
    runs: List[Run] = []
    start = 0
    for n in (int(x) for x in lengths):
        if runs and runs[-1][2] == n and n > 0:
            s, c, _ = runs[-1]
            runs[-1] = (s, c + 1, n)
        elif n > 0:
            runs.append((start, 1, n))
        start += n
    return runs


def segment_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """HF attention interface: ``query`` [1, H, N, D], ``key``/``value`` [1, H_kv, N, D] -> ([1, N, H, D], None)."""
    runs = kwargs.pop("fspo_segments", None)
    if runs is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"segment attention takes one packed row, got a batch of {query.shape[0]}")
    outs = []
    for start, count, length in runs:
        end = start + count * length

        # [1, h, count x length, d] -> [count, h, length, d]
        def batch(x, start=start, end=end, count=count, length=length):
            return x[0, :, start:end].unflatten(1, (count, length)).transpose(0, 1)  # (a strided view)

        out, _ = sdpa_attention_forward(module, batch(query), batch(key), batch(value), None, dropout=dropout,
                                        scaling=scaling, is_causal=True, **kwargs)
        outs.append(out.reshape(1, count * length, *out.shape[2:]))  # [count, length, h, d] -> [1, .., h, d]
    return torch.cat(outs, dim=1), None


AttentionInterface.register(SEGMENT_ATTENTION, segment_attention)
AttentionMaskInterface.register(SEGMENT_ATTENTION, sdpa_mask)


def uses_segment_attention(model) -> bool:
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None) == SEGMENT_ATTENTION


def _full_attention_only(config) -> bool:
    """No sliding-window layer (segment attention attends to the whole of each sequence)."""
    types = getattr(config, "layer_types", None)
    if types:
        return all(t == "full_attention" for t in types)
    return not (getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None))


def enable_segment_attention(model) -> bool:
    """Switch an ``sdpa`` model with full attention in every layer to `SEGMENT_ATTENTION`; whether it uses it."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) == "sdpa" and _full_attention_only(config):
        model.set_attn_implementation(SEGMENT_ATTENTION)
    return uses_segment_attention(model)
