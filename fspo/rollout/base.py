"""The rollout-engine contract: prompts in, a `RolloutBatch` of completions out.

Owns: `SamplingConfig` and the `RolloutEngine` interface. Leaves out: scoring, advantages and
old log-probs (callback.py) and the engines themselves (hf.py, vllm.py).

Lifecycle, driven by the rollout callback:
  1. ``setup(model, tokenizer, workdir)`` once, on the rank that generates; ``model`` is the
     trainer's policy (an HF causal LM), ``workdir`` a scratch folder for exported weights.
  2. each step: ``sync_weights(model)`` pushes the trainer's current parameters into the engine
     (a no-op for engines that share the policy module), then
     ``generate(prompt_token_ids, params)`` returns ``len(prompts) * params.n`` completions, the
     ``n`` completions of prompt k in rows ``k*n .. k*n+n-1`` with ``group_ids == k``.
  3. ``sleep()`` / ``wake(tags)`` around the training pass free engine memory (no-ops by default);
     the order of the memory steps around a generation is engine_memory.py's.
The returned batch fills prompt_ids/prompt_mask (left-padded), response_ids/response_mask
(right-padded, EOS included in the mask), group_ids, overlong, and optionally engine_log_probs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

from fspo.types import RolloutBatch


@dataclass
class SamplingConfig:
    """Sampling settings; ``top_k <= 0`` and ``top_p >= 1`` disable those filters.

    ``min_new_tokens`` suppresses EOS until that many tokens are generated (HF ``min_new_tokens``,
    vLLM ``min_tokens``); benchmarks set it to ``max_new_tokens`` for fixed-length responses."""

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
    """Base class; see the module docstring for the lifecycle."""

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
