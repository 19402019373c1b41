"""Which prompts each RL step sees: a deterministic, resumable batch sampler."""
from __future__ import annotations

from typing import Iterator, List

import torch


class PromptStepSampler:
    """Yields ``steps`` lists of ``prompts_per_step`` prompt indices (one per RL step) from seeded permutations
    of the prompt set (epoch e: ``seed + e``), so the position is one integer and resume is exact. `draw` (dynamic
    sampling) continues the same stream within a step, counted in ``extra``: step k starts at offset
    ``k * prompts_per_step + extra`` (Lightning prefetches no batch, as the loader has a length)."""

    def __init__(self, num_prompts: int, prompts_per_step: int, steps: int, seed: int = 0):
        if num_prompts < 1:
            raise ValueError("the training prompt set is empty: check the data settings (data.*)")
        if prompts_per_step < 1 or steps < 0:
            raise ValueError(f"need prompts_per_step >= 1 and steps >= 0, got {prompts_per_step}, {steps}")
        self.num_prompts, self.prompts_per_step, self.steps, self.seed = num_prompts, prompts_per_step, steps, seed
        self.position = 0  # RL steps already yielded
        self.extra = 0  # prompts drawn by dynamic sampling (`draw`) so far

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
            start = self.position * self.prompts_per_step + self.extra
            batch = [self._prompt_at(k) for k in range(start, start + self.prompts_per_step)]
            self.position += 1
            yield batch

    def step_prompts(self, step: int) -> List[int]:
        """The prompt indices RL step ``step`` is given, without moving (for pipelined rollouts); not defined once
        `draw` has taken extra prompts."""
        if self.extra:
            raise RuntimeError("step_prompts is not defined after draw (dynamic sampling with pipelined rollouts)")
        start = int(step) * self.prompts_per_step
        return [self._prompt_at(k) for k in range(start, start + self.prompts_per_step)]

    def draw(self, count: int) -> List[int]:
        """The next ``count`` prompt indices of the stream, within the current step (counted in ``extra``)."""
        start = self.position * self.prompts_per_step + self.extra
        self.extra += int(count)
        return [self._prompt_at(k) for k in range(start, start + int(count))]

    def state_dict(self) -> dict:
        return {"position": self.position, **({"extra": self.extra} if self.extra else {})}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])
        self.extra = int(state.get("extra", 0))
