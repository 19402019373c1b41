"""Loss aggregation: a [B, T] per-token loss matrix to a scalar, as verl's `agg_loss` does.

Owns: `aggregate`, `AggResult`, `Aggregator` (the Hydra-instantiable wrapper) and `AGG_MODES`.
Leaves out: the per-token losses themselves (fspo/clipping) and the split of a mini-batch into
micro-batches (fspo/module.py), which passes the mini-batch denominators in.

Every mode is a weighted sum of per-sequence token means, loss = sum_i w_i * mean_t(loss_i,t):

| mode                      | loss                                   | w_i                       |
|---------------------------|----------------------------------------|---------------------------|
| token-mean (the paper's)  | sum_{i,t} m l / total_tokens           | L_i / total_tokens        |
| seq-mean-token-mean       | sum_{i: L_i>0} mean_t l_i / total_seqs | [L_i > 0] / total_seqs    |
| seq-mean-token-sum        | sum_i sum_t m l / total_seqs           | L_i / total_seqs          |
| seq-mean-token-sum-norm   | sum_i sum_t m l / norm_len             | L_i / norm_len            |

So token-mean weights each sequence by its length: with a sequence-level ratio (FSPO, RLOO) the
sequence's surrogate is repeated on its L_i tokens and counts L_i times.

Denominators (verl semantics): ``total_tokens`` defaults to sum(m) of this call, ``total_seqs`` to
the number of sequences with L_i > 0 (verl excludes fully-masked rows), ``norm_len`` to T (verl's
max response length; note verl's seq-mean-token-sum-norm has no 1/B). When a mini-batch is split
into micro-batches, pass the mini-batch's ``total_tokens`` / ``total_seqs`` / ``norm_len`` to every
micro-batch call: the micro-batch losses then sum to the mini-batch loss. Clipped sequences stay in
every denominator (paper section Method). A zero denominator gives loss 0 (with a graph).
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
    return (1.0 / _den(norm, torch.tensor(float(t), device=lengths.device))).expand_as(lengths)


_MODES: Dict[str, Callable[..., Tensor]] = {
    "token-mean": _token_mean,
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
    delegates to `aggregate`; a ``norm_len`` given to the call overrides the configured one.
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
                         total_seqs=total_seqs, norm_len=self.norm_len if norm_len is None else norm_len)

    def __repr__(self) -> str:
        return f"Aggregator(mode={self.mode!r}, norm_len={self.norm_len!r})"
