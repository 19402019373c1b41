"""Per-line credit for the modular chain (fspo/data/mod_chain.py), each line parsed by a regular expression.
Line k (k = 1..n) is consistent when it reads ``{n - k + 1:03d}:{d}`` with d = (digit of line k-1 + step) mod 10
(line 0's digit is the prompt's v0) and line k-1 was readable:

    correct_i = (number of consistent lines among the first n) / max(n, number of lines)

so the mean credit is the per-line consistency rate at every length: the reward carries no length by
construction. ``complete`` is 1 when exactly n lines were written.
"""
from __future__ import annotations

import re
from typing import Sequence, Tuple

from fspo.rewards.base import RewardOutput

_LINE = re.compile(r"^(\d{3}):(\d)$")


def line_credit(text: str, v0: int, n: int, step: int = 7) -> Tuple[float, bool]:
    """(consistent lines / max(n, lines written), whether exactly n lines were written)."""
    lines = text.strip("\n").split("\n") if text.strip() else []
    good, prev = 0, v0
    for k, line in enumerate(lines[:n]):
        m = _LINE.match(line.strip())
        if m is None:
            prev = None
            continue
        counter, digit = int(m.group(1)), int(m.group(2))
        if prev is not None and counter == n - k and digit == (prev + step) % 10:
            good += 1
        prev = digit
    return good / max(n, len(lines), 1), len(lines) == n


class ChainConsistencyReward:
    """RewardFn for the modular chain; references are ``"v0,n"``."""

    def __init__(self, step: int = 7, correct_reward: float = 1.0):
        self.step, self.correct_reward = int(step), float(correct_reward)

    def __call__(self, completions: Sequence[str], references: Sequence[str], lengths: Sequence[int],
                 overlong: Sequence[bool], max_new_tokens: int) -> RewardOutput:
        correct, complete, errors = [], [], 0
        for text, ref in zip(completions, references):
            try:
                v0, n = (int(x) for x in ref.split(","))
                c, whole = line_credit(text, v0, n, self.step)
            except Exception:  # a bad reference scores 0, never crashes the step
                errors += 1
                c, whole = 0.0, False
            correct.append(c)
            complete.append(float(whole))
        return RewardOutput(scores=[self.correct_reward * c for c in correct],
                            components={"correct": correct, "complete": complete}, errors=errors)
