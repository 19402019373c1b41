"""Loss aggregation: a [B, T] per-token loss matrix to a scalar, as verl 0.9.1's `agg_loss` does.

Owns: `aggregate`, `AggResult`, `Aggregator` (the Hydra-instantiable wrapper) and `AGG_MODES`.
Leaves out: the per-token losses themselves (fspo/clipping), the split of a mini-batch into
micro-batches (fspo/update/module.py), which passes the mini-batch denominators in, and verl's data-parallel
factor dp_size (this function is single-process: dp_size = 1; fspo/clipping/registry.py applies it).

Every mode is a per-token coefficient k_i times each sequence's token sum, loss = sum_i k_i sum_t m l,
equivalently a weighted sum of per-sequence token means, loss = sum_i w_i mean_t(l_i,t), w_i = k_i L_i:

| mode                      | loss                                        | k_i                          |
|---------------------------|---------------------------------------------|------------------------------|
| token-mean (the paper's)  | sum_{i,t} m l / total_tokens                | 1 / total_tokens             |
| token-sum                 | sum_{i,t} m l                               | 1                            |
| seq-mean-token-mean       | sum_{i: L_i>0} mean_t l_i / total_seqs      | [L_i > 0] / (L_i total_seqs) |
| seq-mean-token-sum        | sum_i sum_t m l / total_seqs                | 1 / total_seqs               |
| seq-mean-token-sum-norm   | sum_i sum_t m l / (total_seqs * norm_len)   | 1 / (total_seqs norm_len)    |

The gradient of token t of sequence i is k_i d l_{i,t}. With the per-token form of a sequence-level
ratio (FSPO's and RLOO's default ``ratio_grad="per_token"``; GSPO's only form: d l_{i,t} / d logp_{i,t}
is the sequence's surrogate derivative on that token alone) every token of sequence i gets weight k_i:
under token-mean the same 1 / total_tokens for all sequences, i.e. the paper's per-sequence weight
up to a batch constant. Only the ``ratio_grad="length_weighted"`` form (the sequence surrogate with
its full gradient through S_i on each of its L_i tokens) makes token-mean weight sequence i by L_i.

Denominators (verl semantics): ``total_tokens`` defaults to sum(m) of this call (verl's
batch_num_tokens), ``total_seqs`` to the number of sequences with L_i > 0 (verl's global_batch_size;
verl excludes fully-masked rows), ``norm_len`` to T = response_mask.shape[-1] (verl's
loss_scale_factor, default the horizon). When a mini-batch is split into micro-batches, pass the
mini-batch's ``total_tokens`` / ``total_seqs`` / ``norm_len`` to every micro-batch call: the
micro-batch losses then sum to the mini-batch loss (micro-batches trimmed to their own length need
an explicit ``norm_len``). Clipped sequences stay in every denominator (paper section Method). A zero
denominator gives loss 0 (with a graph); verl returns NaN there.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Union

import torch
from torch import Tensor

Number = Union[int, float, Tensor]


@dataclass
class AggResult:
    """``loss``: scalar; ``seq_weights``: [B] float32 detached, loss = sum_i w_i mean_t(loss_i,t)."""

    loss: Tensor
    seq_weights: Tensor


def _den(value: Optional[Number], default: Tensor) -> Tensor:
    v = default if value is None else torch.as_tensor(value, dtype=torch.float32, device=default.device)
    return v.to(torch.float32)


# Each mode maps (lengths [B], T, totals) -> per-token coefficient k_i, so loss = sum_i k_i sum_t m l
# and w_i = k_i * L_i.
def _token_mean(lengths: Tensor, t: int, tokens, seqs, norm) -> Tensor:
    return (1.0 / _den(tokens, lengths.sum())).expand_as(lengths)


def _seq_mean_token_mean(lengths: Tensor, t: int, tokens, seqs, norm) -> Tensor:
    n = _den(seqs, (lengths > 0).sum().float())
    return torch.where(lengths > 0, 1.0 / (lengths.clamp(min=1.0) * n), 0.0)


def _seq_mean_token_sum(lengths: Tensor, t: int, tokens, seqs, norm) -> Tensor:
    return (1.0 / _den(seqs, (lengths > 0).sum().float())).expand_as(lengths)


def _seq_mean_token_sum_norm(lengths: Tensor, t: int, tokens, seqs, norm) -> Tensor:
    n = _den(seqs, (lengths > 0).sum().float())
    return (1.0 / (n * _den(norm, torch.tensor(float(t), device=lengths.device)))).expand_as(lengths)


def _token_sum(lengths: Tensor, t: int, tokens, seqs, norm) -> Tensor:
    return torch.ones_like(lengths)


_MODES: Dict[str, Callable[..., Tensor]] = {
    "token-mean": _token_mean,
    "token-sum": _token_sum,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum": _seq_mean_token_sum,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
}
AGG_MODES = tuple(_MODES)


def check_mode(mode: str) -> str:
    """Return ``mode`` if known, else raise ValueError listing the modes."""
    if mode not in _MODES:
        raise ValueError(f"loss_agg_mode must be one of {list(AGG_MODES)}, got {mode!r}")
    return mode


def aggregate(token_loss: Tensor, response_mask: Tensor, mode: str, *,
              total_tokens: Optional[Number] = None, total_seqs: Optional[Number] = None,
              norm_len: Optional[Number] = None) -> AggResult:
    """Aggregate ``token_loss`` [B, T] over ``response_mask`` [B, T] with ``mode`` (see module table).

    Padding entries of ``token_loss`` are ignored (even NaN). Returns the scalar float32 loss and
    the per-sequence weights w_i it applied.
    """
    fn = _MODES[check_mode(mode)]
    if token_loss.shape != response_mask.shape or token_loss.dim() != 2:
        raise ValueError(f"aggregate: token_loss shape {tuple(token_loss.shape)} and response_mask shape "
                         f"{tuple(response_mask.shape)} must be equal and [B, T]")
    m = response_mask.bool()
    lengths = m.sum(-1).float()
    row_sum = torch.where(m, token_loss.float(), 0.0).sum(-1)
    k = fn(lengths, m.shape[-1], total_tokens, total_seqs, norm_len)
    k = torch.where(torch.isfinite(k), k, 0.0)  # zero denominator -> loss 0
    return AggResult(loss=(row_sum * k).sum(), seq_weights=(k * lengths).detach())


class Aggregator:
    """Hydra-friendly aggregation setting: ``Aggregator(mode, norm_len)(token_loss, mask, ...)``.

    ``__call__(token_loss, response_mask, *, total_tokens=None, total_seqs=None, norm_len=None)``
    delegates to `aggregate`. A configured ``norm_len`` (a constant, verl's ``loss_scale_factor``)
    wins over one given to the call; the call's (the training step passes the mini-batch's
    response width, so micro-batches trimmed to their own longest sequence still sum to the
    mini-batch loss) is used when none is configured.
    """

    def __init__(self, mode: str = "token-mean", norm_len: Optional[int] = None) -> None:
        self.mode = check_mode(mode)
        if norm_len is not None and not float(norm_len) > 0:
            raise ValueError(f"Aggregator: norm_len must be > 0 or null, got {norm_len!r}")
        self.norm_len = norm_len

    def __call__(self, token_loss: Tensor, response_mask: Tensor, *,
                 total_tokens: Optional[Number] = None, total_seqs: Optional[Number] = None,
                 norm_len: Optional[Number] = None) -> AggResult:
        return aggregate(token_loss, response_mask, self.mode, total_tokens=total_tokens,
                         total_seqs=total_seqs, norm_len=norm_len if self.norm_len is None else self.norm_len)

    def __repr__(self) -> str:
        return f"Aggregator(mode={self.mode!r}, norm_len={self.norm_len!r})"
