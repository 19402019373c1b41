"""Splitting a rollout batch into PPO mini-batches and token-budget micro-batches.

``ppo.mini_batch_size`` counts ``ppo.mini_batch_unit``s: ``sequences`` (rows shuffled one by one) or ``prompts``
(verl's ``ppo_mini_batch_size``: whole groups of n, so the 1/G group average lies inside one mini-batch).
Micro-batches follow verl's dynamic batch size: sequences sorted by prompt + response length, packed greedily so
that ``rows * longest_row <= max_tokens``; a sequence longer than the budget gets a micro-batch of its own.
"""
from __future__ import annotations

from typing import List, Optional

import torch
from torch import Tensor

from fspo.update.settings import MINI_BATCH_UNITS, check_mini_batch  # noqa: F401  (the batch check, torch-free)


def minibatch_plan(batch_size: int, mini_batch_size: int, epochs: int = 1, generator: Optional[torch.Generator] = None,
                   unit: str = "sequences", group_ids: Optional[Tensor] = None) -> List[Tensor]:
    """A step's mini-batches in training order: ``epochs`` reshuffles of the ``batch_size`` rows into
    mini-batches of ``mini_batch_size`` ``unit``s (``"prompts"``: whole groups by ``group_ids`` [B])."""
    if unit == "sequences":
        return [mb for _ in range(epochs) for mb in minibatch_indices(batch_size, mini_batch_size, generator)]
    if unit != "prompts":
        raise ValueError(f"ppo.mini_batch_unit must be one of {', '.join(MINI_BATCH_UNITS)}, got {unit!r}")
    if group_ids is None or group_ids.numel() != batch_size:
        raise ValueError(f"ppo.mini_batch_unit=prompts needs the batch's group ids ({batch_size} rows), got "
                         f"{None if group_ids is None else group_ids.numel()}")
    return [mb for _ in range(epochs) for mb in group_minibatch_indices(group_ids, mini_batch_size, generator)]


def group_minibatch_indices(group_ids: Tensor, mini_batch_size: int, generator: Optional[torch.Generator] = None,
                            shuffle: bool = True) -> List[Tensor]:
    """Partition the rows into mini-batches of ``mini_batch_size`` whole groups of ``group_ids`` [B] (last may
    have fewer). The groups are shuffled; a mini-batch lists its groups' rows group after group, in batch order."""
    if mini_batch_size < 1:
        raise ValueError(f"ppo.mini_batch_size must be >= 1, got {mini_batch_size}")
    uniq, inv = torch.unique(group_ids.reshape(-1).cpu(), return_inverse=True)
    k = len(uniq)
    if k == 0:
        return []
    order = torch.randperm(k, generator=generator) if shuffle else torch.arange(k)
    slot = torch.empty(k, dtype=torch.long)
    slot[order] = torch.arange(k)  # position of each group in the shuffled order
    rows = torch.argsort(slot[inv], stable=True)
    sizes = torch.bincount(inv, minlength=k)[order]
    return list(rows.split([int(s.sum()) for s in sizes.split(mini_batch_size)]))


def minibatch_indices(batch_size: int, mini_batch_size: int, generator: Optional[torch.Generator] = None,
                      shuffle: bool = True) -> List[Tensor]:
    """Partition ``range(batch_size)`` into PPO mini-batches of ``mini_batch_size`` (last may be smaller)."""
    if mini_batch_size < 1:
        raise ValueError(f"ppo.mini_batch_size must be >= 1, got {mini_batch_size}")
    order = torch.randperm(batch_size, generator=generator) if shuffle else torch.arange(batch_size)
    return list(order.split(mini_batch_size))


def balanced_rank_rows(tokens: Tensor, rank: int, size: int) -> Tensor:
    """This rank's rows (ascending) of a mini-batch whose row i holds ``tokens[i]`` tokens, split over ``size``
    ranks by tokens. Greedy longest-processing-time: rows by length descending (ties: lower index), each to the
    rank with the fewest tokens so far (ties: fewer rows, lower rank); max load <= 4/3 of the best (Graham 1969)."""
    if size <= 1:
        return torch.arange(tokens.numel())
    loads, counts, mine = [0] * size, [0] * size, []
    lengths = [int(t) for t in tokens.tolist()]  # host values: call with a CPU tensor (no device sync)
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(size), key=lambda r: (loads[r], counts[r], r))
        loads[r] += lengths[i]
        counts[r] += 1
        if r == rank:
            mine.append(i)
    return torch.tensor(sorted(mine), dtype=torch.long)


def token_budget_micro_batches(total_lengths: Tensor, max_tokens: int, max_seqs: int = 1 << 30) -> List[Tensor]:
    """Index groups, each sorted by length descending, with ``len(group) * max(total_lengths[group]) <=
    max_tokens`` (``total_lengths`` [B]: prompt + response tokens)."""
    if max_tokens < 1:
        raise ValueError(f"ppo.micro_batch_max_tokens must be >= 1, got {max_tokens}")
    order = torch.argsort(total_lengths, descending=True, stable=True)
    groups, cur, cur_max = [], [], 0
    for i in order.tolist():
        li = int(total_lengths[i])
        new_max = max(cur_max, li)
        if cur and ((len(cur) + 1) * new_max > max_tokens or len(cur) >= max_seqs):
            groups.append(torch.tensor(cur, dtype=torch.long))
            cur, new_max = [], li
        cur.append(i)
        cur_max = new_max
    if cur:
        groups.append(torch.tensor(cur, dtype=torch.long))
    return groups
