"""Per-token log-probabilities of sampled responses under a causal LM: the one forward pass behind both old
log-probs and the policy loss, so both sides of the ratio come from the same computation.

    logp[i, t] = log softmax(logits[i, P - 1 + t] / temperature)[response_ids[i, t]]

in float32 whatever the model's dtype, 0 where ``response_mask`` is 0. Only the K positions that predict response
tokens become log-probs ([K, V], never [B, T, V]); position ids are ``cumsum(attention_mask) - 1``, as in
generation. With ``pack_width`` set the sequences are packed without padding (packing.py) and the result is the
same as the padded pass's.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple, TypeVar

import torch
from torch import Tensor

from fspo.models.segment_attention import uses_segment_attention
from fspo.types import RolloutBatch
from fspo.update.lm_head import chunked_token_logprobs
from fspo.update.packing import TokenUsage, pack_batch, pack_segments

T = TypeVar("T")
R = TypeVar("R")


def in_root_forward(model, fn: Callable[..., T], *args, **kwargs) -> T:
    """``fn(*args, **kwargs)`` run as ``model``'s own forward call, ``model.forward`` shadowed for that call,
    so the root module's hooks run around ``fn``: under FSDP2 they gather the root's sharded parameters (the
    LM head's weight) for forward and backward and reduce-scatter their gradients."""
    if not args:
        raise ValueError("in_root_forward needs at least one positional input (e.g. input_ids): FSDP2's root "
                         "pre-forward indexes the inputs it moves to the device")
    own = vars(model).get("forward")  # an instance-level forward (e.g. set by a wrapper) is put back after
    model.forward = lambda *a, **k: fn(*a, **k)  # instance attribute: shadows the class's forward
    try:
        return model(*args, **kwargs)
    finally:
        if own is None:
            del model.forward
        else:
            model.forward = own


def _run(model, select: Callable[[Tensor], Tensor], head: Optional[Callable[[Tensor], R]] = None, **kw):
    """``select(logits)`` of the model; with ``head``, ``head(select(h))`` of the body's final hidden states,
    inside the model's own forward call (`in_root_forward`)."""
    if head is None:
        return select(model(use_cache=False, **kw).logits)
    kw.pop("logits_to_keep", None)
    input_ids = kw.pop("input_ids")

    def body(ids: Tensor, **inputs):
        return head(select(model.get_decoder()(input_ids=ids, use_cache=False, **inputs).last_hidden_state))

    return in_root_forward(model, body, input_ids, **kw)


def _padded_logits(model, batch: RolloutBatch, usage: Optional[TokenUsage], head=None):
    """[K, V]: the logits predicting the K response tokens (``response_mask`` order), padded pass."""
    input_ids = batch.input_ids()
    attn = batch.attention_mask()
    if usage is not None:
        usage.add(input_ids.numel(), int(attn.sum()))
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
    p, t = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
    mask = batch.response_mask.bool()
    return _run(model, lambda x: x[:, p - 1:p + t - 1][mask], head,
                input_ids=input_ids, attention_mask=attn, position_ids=position_ids)


def _packed_logits(model, batch: RolloutBatch, width: int, usage: Optional[TokenUsage], head=None):
    """[K, V] as `_padded_logits`, from a packed pass (the one-row layout: the LM head at those K only)."""
    mask = batch.response_mask.bool()
    if uses_segment_attention(model):  # one unpadded row; the placeholder 4D mask stops mask building
        lay = pack_segments(batch)
        keep = lay.logit_index[mask]
        kw = dict(attention_mask=torch.ones(1, 1, 1, 1, dtype=torch.bool, device=lay.input_ids.device),
                  fspo_segments=lay.segments, logits_to_keep=keep)
        select = (lambda x: x[0]) if head is None else (lambda x: x[0, keep])  # logits: already kept
    else:
        lay = pack_batch(batch, width)
        kw = dict(attention_mask=None)
        select = lambda x: x.flatten(0, 1)[lay.logit_index[mask]]  # noqa: E731
    if usage is not None:
        usage.add(lay.slots, lay.real_tokens)
    return _run(model, select, head, input_ids=lay.input_ids, position_ids=lay.position_ids, **kw)


def response_log_probs(model, batch: RolloutBatch, temperature: float = 1.0, with_entropy: bool = False,
                       pack_width: Optional[int] = None,
                       usage: Optional[TokenUsage] = None,
                       head_chunk_rows: int = 0) -> Tuple[Tensor, Optional[Tensor]]:
    """(logp [B, T] float32, entropy [B, T] (no gradient) or None). ``pack_width``: None for the padded pass,
    else the packed row width; ``head_chunk_rows`` > 0: the LM head runs in chunks of that many positions."""
    mask = batch.response_mask.bool()

    def head(hidden: Tensor):  # inside the model's forward call: the head's weight is gathered under FSDP
        out = model.get_output_embeddings()
        return chunked_token_logprobs(hidden, out.weight, batch.response_ids[mask], temperature,
                                      head_chunk_rows, bias=out.bias, with_entropy=with_entropy)

    chunked = head if head_chunk_rows > 0 else None
    res = (_padded_logits(model, batch, usage, chunked) if pack_width is None
           else _packed_logits(model, batch, pack_width, usage, chunked))
    if chunked is not None:  # (log-probs, entropies) of the K tokens
        flat, flat_ent = res
        logp = flat.float().new_zeros(batch.response_ids.shape).masked_scatter(mask, flat.float())
        ent = (None if flat_ent is None
               else logp.new_zeros(batch.response_ids.shape).masked_scatter(mask, flat_ent.float()))
        return logp, ent
    logits = res.float()  # [K, V]: only the sampled tokens' positions, never [B, T, V]
    if temperature != 1.0:
        logits = logits / temperature
    logz = torch.logsumexp(logits, dim=-1)
    flat = logits.gather(-1, batch.response_ids[mask].unsqueeze(-1)).squeeze(-1) - logz
    logp = flat.new_zeros(batch.response_ids.shape).masked_scatter(mask, flat)
    ent = None
    if with_entropy:
        with torch.no_grad():
            probs = torch.softmax(logits, dim=-1)
            ent = logz.new_zeros(batch.response_ids.shape).masked_scatter(mask, logz - (probs * logits).sum(-1))
    return logp, ent
