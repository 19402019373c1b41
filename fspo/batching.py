"""Splitting a rollout batch into PPO mini-batches and token-budget micro-batches.

Owns: `PromptStepSampler` (which prompts each RL step sees), `minibatch_indices` (PPO
mini-batches) and `token_budget_micro_batches` (micro-batches for the forward/backward passes).
Leaves out: the loss itself (fspo/module.py, fspo/losses.py).

Micro-batches follow verl's dynamic batch size: sequences are sorted by total length
(prompt + response) and packed greedily so that ``rows * longest_row <= max_tokens`` (the padded
size of the micro-batch), with at most ``max_seqs`` rows. Sorting keeps padding waste low for any
length mix; a single sequence longer than the budget gets a micro-batch of its own.
"""
from __future__ import annotations

from typing import Iterator, List, Optional

import torch
from torch import Tensor


def minibatch_indices(batch_size: int, mini_batch_size: int, generator: Optional[torch.Generator] = None,
                      shuffle: bool = True) -> List[Tensor]:
    """Partition ``range(batch_size)`` into PPO mini-batches of ``mini_batch_size`` (last may be smaller)."""
    if mini_batch_size < 1:
        raise ValueError(f"ppo.mini_batch_size must be >= 1, got {mini_batch_size}")
    order = torch.randperm(batch_size, generator=generator) if shuffle else torch.arange(batch_size)
    return list(order.split(mini_batch_size))


def token_budget_micro_batches(total_lengths: Tensor, max_tokens: int, max_seqs: int = 1 << 30) -> List[Tensor]:
    """Index groups with ``len(group) * max(total_lengths[group]) <= max_tokens`` (padded tokens).

    ``total_lengths`` [B] is each row's prompt+response token count. Returns index tensors into
    the batch, each sorted by length descending.
    """
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


class PromptStepSampler:
    """Batch sampler: yields ``steps`` lists of ``prompts_per_step`` prompt indices.

    Walks through seeded permutations of the prompt set (epoch e uses ``seed + e``), so the
    stream is deterministic and the position is a single integer (`state_dict`), which makes
    mid-run resume exact. One yielded batch = one RL step.
    """

    def __init__(self, num_prompts: int, prompts_per_step: int, steps: int, seed: int = 0):
        if num_prompts < 1:
            raise ValueError("the training prompt set is empty: check data settings")
        if prompts_per_step < 1 or steps < 0:
            raise ValueError(f"need prompts_per_step >= 1 and steps >= 0, got {prompts_per_step}, {steps}")
        self.num_prompts, self.prompts_per_step, self.steps, self.seed = num_prompts, prompts_per_step, steps, seed
        self.position = 0  # RL steps already yielded

    def __len__(self) -> int:
        return self.steps - self.position

    def _prompt_at(self, k: int) -> int:
        epoch, j = divmod(k, self.num_prompts)
        if getattr(self, "_epoch", None) != epoch:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._perm, self._epoch = torch.randperm(self.num_prompts, generator=g).tolist(), epoch
        return self._perm[j]

    def __iter__(self) -> Iterator[List[int]]:
        while self.position < self.steps:
            start = self.position * self.prompts_per_step
            batch = [self._prompt_at(k) for k in range(start, start + self.prompts_per_step)]
            self.position += 1
            yield batch

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])
