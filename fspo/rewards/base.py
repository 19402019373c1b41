"""The reward contract, called once per step on the whole rollout batch:

    reward_fn(completions, references, lengths, overlong, max_new_tokens) -> RewardOutput

``completions[i]`` the decoded response (special tokens stripped), ``references[i]`` its prompt's reference
answer, ``lengths[i]`` its token count, ``overlong[i]`` whether it hit ``max_new_tokens`` without EOS.
``scores[i]`` is the total reward, ``components`` each additive part by name (logged as ``reward/<name>``). A
reward never evaluates model output as code; a failing sample scores 0 and is counted in ``errors``.
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
