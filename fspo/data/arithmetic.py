"""The built-in verifiable task: multi-operand integer arithmetic with worked steps. With k operands::

    prompt:   "Q:23+45-7\nA:"
    solution: "23+45=68\n68-7=61\nAnswer: 61"        (+ EOS)

k-1 step lines, so response lengths grow linearly with k. Train, validation and test
come from three seeds; validation drops prompts of the train split, test those of train and validation.
"""
from __future__ import annotations

import random
from typing import Iterator, List, Tuple

from fspo.data.base import ListSource, Sample
from fspo.seeds import SPLITS, split_seed


def _problem(rng: random.Random, min_ops: int, max_ops: int, max_operand: int) -> Tuple[List[int], List[str]]:
    k = rng.randint(min_ops, max_ops)
    nums = [rng.randint(1, max_operand) for _ in range(k)]
    ops = [rng.choice("+-") for _ in range(k - 1)]
    return nums, ops


def render_prompt(nums: List[int], ops: List[str]) -> str:
    expr = str(nums[0]) + "".join(f"{o}{n}" for o, n in zip(ops, nums[1:]))
    return f"Q:{expr}\nA:"


def worked_solution(nums: List[int], ops: List[str]) -> Tuple[str, int]:
    """The step-by-step solution text and the final value."""
    total, lines = nums[0], []
    for o, n in zip(ops, nums[1:]):
        new = total + n if o == "+" else total - n
        lines.append(f"{total}{o}{n}={new}")
        total = new
    lines.append(f"Answer: {total}")
    return "\n".join(lines), total


class ArithmeticTask(ListSource):
    """``size`` problems of ``split`` from `split_seed` ``(seed, split)``. Val and test exclude the first
    ``exclude_size`` train prompts (default ``10 * size``), test also the val split of ``val_size`` (default
    ``size``). ``meta["nums"]``/``meta["ops"]`` let the warm start render the worked solution."""

    def __init__(self, split: str = "train", size: int = 2000, seed: int = 0, min_ops: int = 2,
                 max_ops: int = 9, max_operand: int = 9, exclude_size: int | None = None,
                 val_size: int | None = None):
        if split not in SPLITS:
            raise ValueError(f"data.split must be 'train', 'val' or 'test', got {split!r}")
        if not 2 <= min_ops <= max_ops:
            raise ValueError(f"need 2 <= data.min_ops <= data.max_ops, got {min_ops}, {max_ops}")
        if size < 1:
            raise ValueError(f"data size must be >= 1, got {size}: the prompt set would be empty")
        self.split, self.size = split, size
        excluded = set()
        if split != "train":  # exclude train prompts from validation and test
            n_ex = size * 10 if exclude_size is None else exclude_size
            excluded = {s.prompt for s in _generate(n_ex, seed, min_ops, max_ops, max_operand)}
        if split == "test":  # ... and validation prompts from test
            val = ArithmeticTask("val", size if val_size is None else val_size, seed, min_ops, max_ops, max_operand,
                                 exclude_size=exclude_size)
            excluded |= {val[i].prompt for i in range(len(val))}
        rng_seed = split_seed(seed, split)
        out: List[Sample] = []
        for s in _generate(size * 3, rng_seed, min_ops, max_ops, max_operand):
            if s.prompt not in excluded:
                out.append(s)
            if len(out) == size:
                break
        super().__init__(out, name=f"arithmetic/{split}")


def _generate(n: int, seed: int, min_ops: int, max_ops: int, max_operand: int) -> Iterator[Sample]:
    """Up to ``n`` problems from ``seed``, made as they are taken (a split stops once it has its size)."""
    rng = random.Random(seed)
    for i in range(n):
        nums, ops = _problem(rng, min_ops, max_ops, max_operand)
        _, total = worked_solution(nums, ops)
        yield Sample(prompt=render_prompt(nums, ops), answer=str(total),
                     meta={"source": "arithmetic", "row": i, "nums": nums, "ops": ops})
