"""The rollout-engine contract: prompts in, a `RolloutBatch` of completions out.

Lifecycle, driven by the rollout callback: ``setup(model, tokenizer, workdir)`` once; each step
``sync_weights(model)`` (a no-op for engines sharing the policy module), then ``generate(prompt_token_ids,
params)``: ``len(prompts) * params.n`` completions, those of prompt k in rows ``k*n .. k*n+n-1`` with
``group_ids == k``, prompts left-padded, responses right-padded (EOS in the mask), optionally
``engine_log_probs``; ``sleep()`` / ``wake(tags)`` free engine memory around training (engine_memory.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

from fspo.types import RolloutBatch


@dataclass
class SamplingConfig:
    """Sampling settings; ``top_k <= 0`` and ``top_p >= 1`` disable those filters; ``min_new_tokens`` suppresses
    EOS until that many tokens are generated."""

    n: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 128
    seed: Optional[int] = None
    min_new_tokens: int = 0

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"rollout.sampling.n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"rollout.sampling.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.sampling.top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"rollout.sampling.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(f"rollout.sampling.min_new_tokens must be in [0, max_new_tokens="
                             f"{self.max_new_tokens}], got {self.min_new_tokens}")


class RolloutEngine:
    """Base class of the engines."""

    def setup(self, model, tokenizer, workdir: str) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.workdir = workdir

    def sync_weights(self, model) -> None:
        """Push the trainer's current parameters into the engine. Default: shared module, no-op."""

    def generate(self, prompt_token_ids: Sequence[List[int]], params: SamplingConfig) -> RolloutBatch:
        raise NotImplementedError

    def sleep(self) -> None:
        """Free engine memory while the trainer runs (GPU engines)."""

    def wake(self, tags: Optional[Sequence[str]] = None) -> None:
        """Undo `sleep` for the parts named in ``tags`` ("weights", "kv_cache"; None: everything)."""

    def shutdown(self) -> None:
        """Stop the engine and free what it holds (the run calls it once, after training); a no-op by default."""
