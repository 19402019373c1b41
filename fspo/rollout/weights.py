"""Stream the trainer's full (unsharded) HF state dict, one tensor at a time.

Owns: `iter_full_state_dict`, the weight source for engine weight sync (vllm.py; `engine_weights`
picks it, or the merged weights of a LoRA policy),
and `checkpoint_name`, which maps wrapped parameter names back to the HF checkpoint names.
Leaves out: where the tensors go (the engine) and when sync happens (the rollout callback).

Works for plain tensors and for FSDP2 / tensor-parallel DTensors. A DTensor is gathered with
``full_tensor()`` only when the consumer asks for it, so at most one gathered parameter per rank
is alive beyond the shards (the consumer copies it into the engine and drops it before the next).
Given the engine's ``dtype`` (e.g. bfloat16 beside float32 masters), each shard is cast to it before
the gather (fspo/models/gather.py): half the bytes on the wire and in the gathered copy, same values.
``full_tensor()`` is a collective: under FSDP, EVERY rank of the mesh must iterate this generator
to the end in the same order (non-engine ranks just drain it, see `drain`), or the job deadlocks.
"""
from __future__ import annotations

from typing import Iterator, Optional, Tuple

import torch
from torch import Tensor, nn

from fspo.models.gather import gathered

# Prefixes that wrappers insert into parameter names and that HF checkpoints do not have.
_WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.", "module.")


def checkpoint_name(name: str) -> str:
    """``name`` with wrapper segments (torch.compile, activation checkpointing, FSDP1, DDP) removed.

    E.g. ``model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight`` ->
    ``model.layers.0.mlp.up_proj.weight``; an HF name is returned unchanged.
    """
    for p in _WRAPPER_PREFIXES:
        while name.startswith(p):
            name = name[len(p):]
        name = name.replace("." + p, ".")
    return name


def iter_full_state_dict(model: nn.Module, include_tied_lm_head: bool = True, dtype: Optional[torch.dtype] = None
                         ) -> Iterator[Tuple[str, Tensor]]:
    """Yield ``(hf_name, full_tensor)`` for every entry of ``model.state_dict()``, in order.

    Contract:
      - names are HF checkpoint names (wrapper prefixes stripped by `checkpoint_name`);
      - each tensor is the full, unsharded value (DTensors gathered lazily, one at a time), detached,
        on the parameter's device, in its dtype or, given ``dtype``, in `fspo.models.gather.wire_dtype`
        (``dtype`` where that is no wider: a DTensor's shards are cast before they are gathered);
        the caller must not keep references if memory matters;
      - with tied embeddings (``config.tie_word_embeddings``) ``lm_head.weight`` is yielded even if
        the state dict omits it (vLLM's in-place reload expects it), as the embedding matrix;
      - every rank must consume the whole iterator when parameters are DTensors (module docstring).
    """
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
    """What an engine holding a plain HF model in ``dtype`` loads: `iter_full_state_dict`, or for a LoRA
    policy the weights with the adapters merged (`fspo.models.lora.merged_weights`, HF names, same contract);
    either gathered in ``dtype`` where it is no wider than the trainer's (``None``: the trainer's dtypes)."""
    from fspo.models.lora import is_lora, merged_weights

    return merged_weights(model, dtype) if is_lora(model) else iter_full_state_dict(model, dtype=dtype)


def drain(model: nn.Module, dtype: Optional[torch.dtype] = None) -> int:
    """Run `engine_weights(model, dtype)` to the end and discard the tensors; returns the tensor count.

    For ranks that hold no engine under FSDP: they must join every gather the engine rank makes, in the
    same ``dtype`` (an all-gather's ranks must agree on it).
    """
    n = 0
    with torch.no_grad():
        for _ in engine_weights(model, dtype):
            n += 1
    return n
