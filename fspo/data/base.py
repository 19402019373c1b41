"""The prompt-source contract: a sized, indexable collection of `Sample`s (prompts already rendered with their
template; the split chosen when the source is built)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Protocol


@dataclass
class Sample:
    """``prompt``: the exact text fed to the tokenizer; ``answer``: the reward's reference; ``meta``: provenance."""

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
