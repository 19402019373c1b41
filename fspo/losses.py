"""Loss aggregation: a [B, T] per-token loss to a scalar, as verl 0.9.1's `agg_loss` (dp_size = 1; the registry
applies verl's dp_size). Every mode is a per-token coefficient k_i on each sequence's token sum, loss =
sum_i k_i sum_t m l = sum_i w_i mean_t(l_i,t), w_i = k_i L_i:

| mode                      | loss                                        | k_i                          |
|---------------------------|---------------------------------------------|------------------------------|
| token-mean (the paper's)  | sum_{i,t} m l / total_tokens                | 1 / total_tokens             |
| token-sum                 | sum_{i,t} m l                               | 1                            |
| seq-mean-token-mean       | sum_{i: L_i>0} mean_t l_i / total_seqs      | [L_i > 0] / (L_i total_seqs) |
| seq-mean-token-sum        | sum_i sum_t m l / total_seqs                | 1 / total_seqs               |
| seq-mean-token-sum-norm   | sum_i sum_t m l / (total_seqs * norm_len)   | 1 / (total_seqs norm_len)    |

Token t of sequence i gets gradient k_i d l_{i,t}, so with the per-token form of a sequence ratio
(fspo/clipping/base.py) token-mean weights every sequence alike, the paper's weight up to a batch constant.
Denominators (verl's): ``total_tokens`` defaults to sum(m) (batch_num_tokens), ``total_seqs`` to the rows with
L_i > 0 (global_batch_size), ``norm_len`` to T (loss_scale_factor). Micro-batches pass the mini-batch's
denominators so their losses sum to the mini-batch loss. Clipped sequences stay in every denominator (paper
section Method); a zero denominator gives loss 0 (verl: NaN).
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


# each mode: (lengths [B], T, totals) -> k_i
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
    """``mode`` if known, else ValueError listing the modes."""
    if mode not in _MODES:
        raise ValueError(f"loss_agg_mode must be one of {list(AGG_MODES)}, got {mode!r}")
    return mode


def aggregate(token_loss: Tensor, response_mask: Tensor, mode: str, *,
              total_tokens: Optional[Number] = None, total_seqs: Optional[Number] = None,
              norm_len: Optional[Number] = None) -> AggResult:
    """Aggregate ``token_loss`` [B, T] over ``response_mask`` [B, T] with ``mode`` (module table); padding ignored
    (even NaN). Returns the float32 loss and the per-sequence weights w_i."""
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
    """Hydra-instantiable `aggregate` with a ``mode``; a configured ``norm_len`` (verl's ``loss_scale_factor``) wins
    over the call's (the training step passes the mini-batch's response width)."""

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
