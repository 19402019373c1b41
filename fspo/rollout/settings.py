"""The rollout's settings as plain values, checked without torch (stored as schemas by fspo/config).

Owns: `SamplingConfig` (``rollout.sampling``, ``val.sampling``) and `CorrectionSettings` (``rollout_correction``'s
keys, defaults and docs). Leaves out: the engines (base.py, hf.py, vllm.py) and the correction (correction.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from omegaconf import MISSING


@dataclass
class SamplingConfig:
    """Sampling settings; ``top_k <= 0`` and ``top_p >= 1`` disable those filters.

    ``min_new_tokens`` suppresses EOS until that many tokens are generated (HF ``min_new_tokens``,
    vLLM ``min_tokens``); benchmarks set it to ``max_new_tokens`` for fixed-length responses."""

    n: int = 8  # completions per prompt, the group of the advantages (G; the paper: 16)
    temperature: float = 1.0  # sampling temperature (validation: 0 is greedy)
    top_p: float = 1.0  # nucleus mass, in (0, 1]; 1: off
    top_k: int = 0  # top-k filter; <= 0: off
    max_new_tokens: int = 128  # the longest response sampled
    seed: Optional[int] = None  # the engine's sampling seed (set by the run, not in conf/)
    min_new_tokens: int = 0  # EOS suppressed before this many tokens (benchmarks: = max_new_tokens)

    def __post_init__(self):
        key, n, new, lo = "rollout.sampling", self.n, self.max_new_tokens, self.min_new_tokens
        for bad, name, problem in (
                (n < 1, "n", "must be a whole number >= 1 (completions per prompt)"),
                (self.temperature < 0, "temperature", "must be a number >= 0 (the sampling temperature)"),
                (not 0 < self.top_p <= 1, "top_p", "must be a number in (0, 1] (nucleus sampling mass)"),
                (new < 1, "max_new_tokens", "must be a whole number >= 1 (the longest response)")):
            if bad:
                default = getattr(SamplingConfig, name)
                raise ValueError(f"{key}.{name}={getattr(self, name):g}: {problem}; set {key}.{name}={default}")
        if not 0 <= lo <= new:
            raise ValueError(f"{key}.min_new_tokens={lo}: must be in [0, {key}.max_new_tokens={new}]; lower it or "
                             f"raise {key}.max_new_tokens")


@dataclass
class CorrectionSettings:
    """``rollout_correction:``: `RolloutCorrection`'s settings (a detached weight per token)."""

    mode: str = "none"  # none | token_tis | seq_is | seq_mask | seq_masked_is | seq_fair_mask | ..._tis
    cap: float = 2.0  # fixed modes: cap on exp(d_t) / exp(S) (verl threshold 2.0, TRL cap 3.0)
    cap_min: Optional[float] = None  # fixed modes: the ratio's floor; null: 1/cap for seq_mask, else none
    z: float = 3.0  # fair modes: h(L) = z s sqrt(L), or the erf(z/sqrt2) quantile (band: quantile)
    band: str = "sqrt"  # sqrt | quantile (fspo/clipping/quantile_band.py, per geometric length bin)
    off_policy_mask: str = "none"  # none | mean (DeepSeek-V3.2 OPSM) | sqrt (length-fair, docs/mismatch.md)
    off_policy_threshold: Optional[float] = None  # delta: per token (mean) or per sqrt(token) (sqrt)
    old_log_probs: str = MISSING  # mirror of ppo.old_log_probs
    temperature: float = MISSING  # mirror of ppo.logprob_temperature
    bin_width: int = MISSING  # mirror of diagnostics.bin_width
    max_len: int = MISSING  # mirror of diagnostics.max_len
    lre_min_len: Any = MISSING  # mirror of diagnostics.lre_min_len
