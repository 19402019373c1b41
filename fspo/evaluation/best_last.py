"""The paper's best/last rule for a run's checkpoints (or a metric's logged history), defined once.

Owns: `best_last`. Given values in step order: **best** is the highest value (ties: the earliest
step), **last** the value at the largest step. Used by the evaluation summary
(summary.py, per benchmark over checkpoints) and by the sweep report
(fspo/evaluation/report/collect.py, over a metric's logged history).
"""
from __future__ import annotations

from typing import Sequence, Tuple


def best_last(values: Sequence[float]) -> Tuple[int, int]:
    """(index of the best value, index of the last value) of ``values`` given in step order."""
    if not len(values):
        raise ValueError("best_last needs at least one value")
    best = max(range(len(values)), key=lambda i: values[i])  # max keeps the first: ties -> the earliest
    return best, len(values) - 1
