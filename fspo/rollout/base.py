"""The rollout-engine contract: prompts in, a `RolloutBatch` of completions out.

Lifecycle, driven by the rollout callback: ``setup(model, tokenizer, workdir)`` once; each step
``sync_weights(model)`` (a no-op for engines sharing the policy module), then ``generate(prompt_token_ids,
params)``: ``len(prompts) * params.n`` completions, those of prompt k in rows ``k*n .. k*n+n-1`` with
``group_ids == k``, prompts left-padded, responses right-padded (EOS in the mask), optionally
``engine_log_probs``; ``sleep()`` / ``wake(tags)`` free engine memory around training (engine_memory.py).
"""
from __future__ import annotations

from typing import List, Optional, Sequence

from fspo.rollout.settings import SamplingConfig
from fspo.types import RolloutBatch


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
