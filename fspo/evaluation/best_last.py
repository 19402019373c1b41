"""The paper's best/last rule, defined once: of values in step order, **best** is the highest (ties: the
earliest), **last** the value at the largest step.
"""
from __future__ import annotations

from typing import Sequence, Tuple


def best_last(values: Sequence[float]) -> Tuple[int, int]:
    """(index of the best value, index of the last value) of ``values`` given in step order."""
    if not len(values):
        raise ValueError("best_last needs at least one value")
    best = max(range(len(values)), key=lambda i: values[i])  # max keeps the first: ties -> the earliest
    return best, len(values) - 1
