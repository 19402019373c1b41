"""The length-law task: a modular chain whose every line is the same kind of step. A problem is a start digit v0
and a line count n (log-uniform in ``min_lines..max_lines``)::

    prompt:   "Q:3,005\nA:"                        (always 10 characters: n is zero-padded)
    response: "005:0\n004:7\n003:4\n002:1\n001:8"     (+ EOS)

Line k is ``{n - k + 1:03d}:{v_k}``, v_k = (v_{k-1} + step) mod 10: 6 tokens a line. The prompt length does not
depend on n and the reward has the same mean at every n, so it isolates the length law (docs/length_law.md).
"""
from __future__ import annotations

import math
import random
from typing import List, Optional

from fspo.data.base import ListSource, Sample
from fspo.seeds import SPLITS, split_seed


def render_prompt(v0: int, n: int) -> str:
    return f"Q:{v0},{n:03d}\nA:"


def chain_lines(v0: int, n: int, step: int = 7) -> List[str]:
    """The n reference lines ``{counter:03d}:{digit}`` (no newlines)."""
    out, v = [], v0
    for k in range(n):
        v = (v + step) % 10
        out.append(f"{n - k:03d}:{v}")
    return out


def demonstration(v0: int, n: int, slip: float, rng: random.Random, step: int = 7) -> str:
    """A demonstration whose digit slips (a wrong digit, drawn uniformly from the other nine) on a fraction
    ``slip`` of the lines; the next line continues from the slipped digit, so each slip costs one line."""
    out, v = [], v0
    for k in range(n):
        right = (v + step) % 10
        v = rng.choice([d for d in range(10) if d != right]) if rng.random() < slip else right
        out.append(f"{n - k:03d}:{v}")
    return "\n".join(out)


def _log_uniform_int(rng: random.Random, lo: int, hi: int) -> int:
    return min(hi, max(lo, int(math.floor(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))))))


class ModChainTask(ListSource):
    """``size`` problems of ``split`` (seeds as `ArithmeticTask`), v0 uniform in 0..9; prompts repeat across
    splits by design (the task measures the clip, not generalisation). ``answer`` is ``"v0,n"``."""

    def __init__(self, split: str = "train", size: int = 20000, seed: int = 0, min_lines: int = 4,
                 max_lines: int = 100, step: int = 7, exclude_size: Optional[int] = None):
        if split not in SPLITS:
            raise ValueError(f"data.split must be 'train', 'val' or 'test', got {split!r}")
        if not 1 <= min_lines <= max_lines <= 999:
            raise ValueError(f"need 1 <= min_lines <= max_lines <= 999 (a 3-digit counter), "
                             f"got {min_lines}, {max_lines}")
        if size < 1:
            raise ValueError(f"data size must be >= 1, got {size}: the prompt set would be empty")
        if step % 10 == 0:
            raise ValueError(f"data step must not be a multiple of 10 (the digit would never change), got {step}")
        rng = random.Random(split_seed(seed, split))
        out = []
        for i in range(size):
            n, v0 = _log_uniform_int(rng, min_lines, max_lines), rng.randrange(10)
            out.append(Sample(prompt=render_prompt(v0, n), answer=f"{v0},{n}",
                              meta={"source": "mod_chain", "row": i, "v0": v0, "n": n, "step": step}))
        super().__init__(out, name=f"mod_chain/{split}")
