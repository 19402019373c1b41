"""The rollout-engine contract: prompts in, a `RolloutBatch` of completions out.

Owns: the `RolloutEngine` interface (its `SamplingConfig`: settings.py). Leaves out: scoring, advantages and
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

from typing import List, Optional, Sequence

from fspo.rollout.settings import SamplingConfig
from fspo.types import RolloutBatch


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
