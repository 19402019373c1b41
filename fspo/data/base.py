"""The prompt-source contract: what the rollout callback and the evaluator sample from.

Owns: `Sample` and `PromptSource`. Leaves out: concrete tasks (arithmetic.py, the math loaders)
and templating details (a source returns prompts already rendered with its template).

A `PromptSource` is a sized, indexable collection of `Sample`s (a map-style dataset); split
selection (train / validation) happens when the source is built, from config.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Protocol


@dataclass
class Sample:
    """One prompt: ``prompt`` is the exact text fed to the tokenizer (template applied),
    ``answer`` the reference the reward function compares against, ``meta`` free-form
    provenance (source file, row, problem id)."""

    prompt: str
    answer: str
    meta: Dict[str, Any] = field(default_factory=dict)


class PromptSource(Protocol):
    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> Sample: ...


class ListSource:
    """A `PromptSource` over an in-memory list; raises a clear error when empty."""

    def __init__(self, samples: List[Sample], name: str = "prompts"):
        if len(samples) == 0:
            raise ValueError(f"prompt set '{name}' is empty: check the data path and filters in conf/data")
        self.samples = samples
        self.name = name

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> Sample:
        return self.samples[i]
