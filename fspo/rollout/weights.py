"""Stream the trainer's full (unsharded) HF state dict, one tensor at a time: the engines' weight source.

A DTensor is gathered with ``full_tensor()`` only when the consumer asks for it (cast to the engine's ``dtype``
first), so at most one gathered parameter per rank is alive beyond the shards. The gather is a collective: under
FSDP EVERY rank iterates the generator to the end in the same order (see `drain`).
"""
from __future__ import annotations

from typing import Iterator, Optional, Tuple

import torch
from torch import Tensor, nn

from fspo.models.gather import gathered

# Prefixes that wrappers insert into parameter names and that HF checkpoints do not have.
_WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "module.")


def checkpoint_name(name: str) -> str:
    """``name`` with wrapper segments (torch.compile, activation checkpointing, FSDP1, DDP) removed."""
    for p in _WRAPPER_PREFIXES:
        while name.startswith(p):
            name = name[len(p):]
        name = name.replace("." + p, ".")
    return name


def iter_full_state_dict(model: nn.Module, include_tied_lm_head: bool = True, dtype: Optional[torch.dtype] = None
                         ) -> Iterator[Tuple[str, Tensor]]:
    """``(hf_name, full detached tensor)`` for every entry of ``model.state_dict()``, in order, in ``dtype`` where
    no wider; with tied embeddings ``lm_head.weight`` too (vLLM's in-place reload expects it)."""
    state = model.state_dict()  # keeps DTensors sharded; no copy of plain tensors
    seen_lm_head = False
    embed_name = None
    for raw, t in state.items():
        name = checkpoint_name(raw)
        if name.endswith("rotary_emb.inv_freq"):
            continue  # a derived buffer, never in a checkpoint
        seen_lm_head |= name == "lm_head.weight"
        if name.endswith("embed_tokens.weight"):
            embed_name = raw
        yield name, gathered(t, dtype)
    config = getattr(model, "config", None)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    if include_tied_lm_head and tied and not seen_lm_head and embed_name is not None:
        yield "lm_head.weight", gathered(state[embed_name], dtype)


def engine_weights(model: nn.Module, dtype: Optional[torch.dtype] = None) -> Iterator[Tuple[str, Tensor]]:
    """What an engine holding a plain HF model in ``dtype`` loads: `iter_full_state_dict`, or for a LoRA policy
    the weights with the adapters merged (`merged_weights`)."""
    from fspo.models.lora import is_lora, merged_weights

    return merged_weights(model, dtype) if is_lora(model) else iter_full_state_dict(model, dtype=dtype)


def drain(model: nn.Module, dtype: Optional[torch.dtype] = None) -> int:
    """Run `engine_weights(model, dtype)` to the end, discarding the tensors (a rank without an engine joins
    every gather, in the same ``dtype``); returns the tensor count."""
    n = 0
    with torch.no_grad():
        for _ in engine_weights(model, dtype):
            n += 1
    return n
