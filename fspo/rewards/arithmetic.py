"""Exact-answer reward for the built-in arithmetic task: the last ``Answer: <int>`` line, parsed by a regular
expression (never evaluated), against the reference integer.

    correct_i = 1[parsed answer == reference]        format_i = 1[an "Answer: <int>" line exists]
    score_i   = correct_reward * correct_i + format_reward * format_i
"""
from __future__ import annotations

import re
from typing import Sequence

from fspo.rewards.base import RewardOutput

_ANSWER = re.compile(r"Answer:\s*(-?\d{1,12})\s*$")


def parse_answer(text: str):
    """The integer on the last 'Answer: N' line, or None."""
    for line in reversed(text.strip().splitlines()):
        m = _ANSWER.search(line.strip())
        if m:
            return int(m.group(1))
    return None


class ArithmeticReward:
    """RewardFn for the arithmetic task."""

    def __init__(self, correct_reward: float = 1.0, format_reward: float = 0.0):
        self.correct_reward = float(correct_reward)
        self.format_reward = float(format_reward)

    def __call__(self, completions: Sequence[str], references: Sequence[str], lengths: Sequence[int],
                 overlong: Sequence[bool], max_new_tokens: int) -> RewardOutput:
        correct, fmt, errors = [], [], 0
        for text, ref in zip(completions, references):
            try:
                got = parse_answer(text)
                fmt.append(float(got is not None))
                correct.append(float(got is not None and got == int(ref)))
            except Exception:  # a bad reference or odd text scores 0, never crashes the step
                errors += 1
                fmt.append(0.0)
                correct.append(0.0)
        scores = [self.correct_reward * c + self.format_reward * f for c, f in zip(correct, fmt)]
        return RewardOutput(scores=scores, components={"correct": correct, "format": fmt}, errors=errors)
