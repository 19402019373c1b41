"""Verifiable math reward: final-answer extraction + math-verify equivalence, with DAPO's optional soft overlong
penalty. Per completion i with extracted answer a_i (None when there is none) and reference r_i::

    format_i  = 1[a_i is not None]
    correct_i = 1[fast_equal(a_i, r_i)]      if that decides (exact string / plain-number match)
              = 1[math_verify(a_i, r_i)]      otherwise, in a worker, within timeout_s seconds
    penalty_i = min(0, (max_new_tokens - B - L_i) / B) * factor    if B = overlong_buffer_len > 0
    score_i   = (correct_reward if correct_i else incorrect_reward) + format_reward * format_i + penalty_i

A check that raises or overruns scores like an incorrect answer (never better, so unverifiable output gains
nothing) and counts in ``errors``. Model output is never evaluated as code: math-verify's parser runs in a
separate process under a deadline and an address-space limit.
"""
from __future__ import annotations

from contextlib import suppress
from typing import Dict, List, Optional, Sequence, Tuple

from fspo.rewards.answer_extraction import extract_answer, fast_equal
from fspo.rewards.base import RewardOutput
from fspo.rewards.verify_pool import DEFAULT_CHECK, VerifyPool


def overlong_penalty(length: int, max_new_tokens: int, buffer_len: int, factor: float) -> float:
    """DAPO's soft overlong punishment: 0 up to E = max_new_tokens - buffer_len, then linear down to ``-factor``
    at ``max_new_tokens``; 0 when ``buffer_len <= 0``."""
    if buffer_len <= 0:
        return 0.0
    return min(0.0, (max_new_tokens - buffer_len - length) / buffer_len) * factor


class MathVerifyReward:
    """RewardFn for math with verifiable answers. ``timeout_s``, ``num_workers``, ``memory_mb`` and ``check``
    (``"module:function"`` of ``(pred, ref) -> bool``) configure the `VerifyPool`; ``fast_path`` False sends
    every extracted answer to the check."""

    def __init__(self, correct_reward: float = 1.0, incorrect_reward: float = 0.0, format_reward: float = 0.0,
                 timeout_s: float = 1.0, num_workers: int = 2, max_answer_chars: int = 1000,
                 overlong_buffer_len: int = 0, overlong_penalty_factor: float = 1.0, memory_mb: int = 2048,
                 check: str = DEFAULT_CHECK, fast_path: bool = True):
        if overlong_buffer_len < 0 or overlong_penalty_factor < 0:
            raise ValueError("overlong_buffer_len and overlong_penalty_factor must be >= 0 "
                             f"(got {overlong_buffer_len}, {overlong_penalty_factor})")
        if max_answer_chars < 1:
            raise ValueError(f"max_answer_chars must be >= 1, got {max_answer_chars}")
        self.correct_reward, self.incorrect_reward = float(correct_reward), float(incorrect_reward)
        self.format_reward = float(format_reward)
        self.max_answer_chars = int(max_answer_chars)
        self.overlong_buffer_len = int(overlong_buffer_len)
        self.overlong_penalty_factor = float(overlong_penalty_factor)
        self._pool_args = dict(num_workers=num_workers, timeout_s=timeout_s, memory_mb=memory_mb, check=check)
        VerifyPool(**self._pool_args)  # validate the arguments now, start nothing
        self.fast_path = bool(fast_path)
        self._pool: Optional[VerifyPool] = None
        self.last_stats: Dict[str, int] = {}

    @property
    def pool(self) -> VerifyPool:
        """The worker pool, created on first use."""
        if self._pool is None:
            self._pool = VerifyPool(**self._pool_args)
        return self._pool

    def judge(self, completions: Sequence[str],
              references: Sequence[str]) -> Tuple[List[float], List[float], List[str]]:
        """(correct, format, status) per completion; status: fast, verified, no_answer, error or timeout."""
        n = len(completions)
        correct, fmt, status = [0.0] * n, [0.0] * n, ["no_answer"] * n
        tasks: Dict[Tuple[str, str], List[int]] = {}
        for i, (text, ref) in enumerate(zip(completions, references)):
            try:
                ans = extract_answer(text, self.max_answer_chars)
                if ans is None:
                    continue
                fmt[i] = 1.0
                ref = str(ref).strip()
                quick = fast_equal(ans, ref) if self.fast_path else None
                if quick is not None:
                    correct[i], status[i] = float(quick), "fast"
                else:
                    tasks.setdefault((ans, ref), []).append(i)
            except Exception:  # e.g. a non-string completion: score 0, count it
                status[i] = "error"
        keys = list(tasks)
        for key, (st, value) in zip(keys, self.pool.run(keys) if keys else []):
            for i in tasks[key]:
                if st == "ok":
                    correct[i], status[i] = float(bool(value)), "verified"
                else:
                    status[i] = st
        return correct, fmt, status

    def __call__(self, completions: Sequence[str], references: Sequence[str], lengths: Sequence[int],
                 overlong: Sequence[bool], max_new_tokens: int) -> RewardOutput:
        """Score a rollout batch (the RewardFn contract in base.py)."""
        n = len(completions)
        if not (len(references) == len(lengths) == len(overlong) == n):
            raise ValueError(f"reward inputs differ in length: completions {n}, references {len(references)}, "
                             f"lengths {len(lengths)}, overlong {len(overlong)}")
        if self.overlong_buffer_len > max_new_tokens:
            raise ValueError(f"reward.overlong_buffer_len ({self.overlong_buffer_len}) must be <= max_new_tokens "
                             f"({max_new_tokens}): every response would be penalised")
        correct, fmt, status = self.judge(completions, references)
        penalty = [overlong_penalty(int(L), max_new_tokens, self.overlong_buffer_len, self.overlong_penalty_factor)
                   for L in lengths]
        scores = [(self.correct_reward if c else self.incorrect_reward) + self.format_reward * f + p
                  for c, f, p in zip(correct, fmt, penalty)]
        self.last_stats = {k: status.count(k) for k in ("fast", "verified", "no_answer", "error", "timeout")}
        errors = self.last_stats["error"] + self.last_stats["timeout"]
        return RewardOutput(scores=scores, components={"correct": correct, "format": fmt, "overlong_penalty": penalty},
                            errors=errors)

    def close(self) -> None:
        """Stop the worker processes (they are restarted on the next call)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __getstate__(self):  # picklable (e.g. saved hyper-parameters, spawned ranks): drop the live pool
        state = dict(self.__dict__)
        state["_pool"] = None
        return state

    def __del__(self):
        with suppress(Exception):
            self.close()
