"""The reward contract: completions and references in, scores and their components out.

Owns: `RewardOutput` and the `RewardFn` interface. Leaves out: the verifiers (one per file in
this package) and advantages (fspo/advantages.py).

A reward function is called once per step on the whole rollout batch:

    reward_fn(completions, references, lengths, overlong, max_new_tokens) -> RewardOutput

where ``completions[i]`` is the decoded response text (special tokens stripped), ``references[i]``
the reference answer of its prompt, ``lengths[i]`` its token count, ``overlong[i]`` whether it hit
``max_new_tokens`` without EOS. ``scores[i]`` is the total reward, and ``components`` holds each
additive part by name (e.g. ``{"correct": [...], "overlong_penalty": [...]}``) so each can be
logged as ``reward/<name>``. A reward function never evaluates model output as code, and a failure
on one sample scores that sample 0 and is counted in ``errors`` rather than raised.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Protocol, Sequence


@dataclass
class RewardOutput:
    scores: List[float]
    components: Dict[str, List[float]] = field(default_factory=dict)
    errors: int = 0


class RewardFn(Protocol):
    def __call__(self, completions: Sequence[str], references: Sequence[str], lengths: Sequence[int],
                 overlong: Sequence[bool], max_new_tokens: int) -> RewardOutput: ...
