"""Verifiable math reward: final-answer extraction + math-verify equivalence, with DAPO's optional
soft overlong penalty.

Owns: `MathVerifyReward` (a `RewardFn`, see base.py) and `overlong_penalty`. Leaves
out: extraction details (answer_extraction.py) and the worker pool that enforces the
per-check deadline (verify_pool.py).

Per completion i with extracted answer a_i (None when there is none) and reference r_i::

    format_i  = 1[a_i is not None]
    correct_i = 1[fast_equal(a_i, r_i)]      if that decides (exact string / plain-number match)
              = 1[math_verify(a_i, r_i)]      otherwise, in a worker, within timeout_s seconds
    penalty_i = min(0, (max_new_tokens - B - L_i) / B) * factor    if B = overlong_buffer_len > 0
    score_i   = (correct_reward if correct_i else incorrect_reward) + format_reward * format_i + penalty_i

A check that raises or overruns ``timeout_s`` scores like an incorrect answer (``incorrect_reward``,
0.0 by default -- never better than a wrong answer, so the policy gains nothing by producing
unverifiable output) and is counted in ``RewardOutput.errors``; ``last_stats`` splits
errors from timeouts. Components: ``correct`` and ``format`` (0/1 indicators) and
``overlong_penalty`` (the additive penalty).

Safety: model output is never evaluated as code. Extraction is regex/brace scanning; the only
interpretation of an answer is math-verify's LaTeX/expression parser (ANTLR grammar -> sympy), run
in a separate process under a hard deadline and an address-space limit. There is no eval, exec or
sympify of raw strings anywhere in this reward.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from fspo.rewards.answer_extraction import extract_answer, fast_equal
from fspo.rewards.base import RewardOutput
from fspo.rewards.verify_pool import DEFAULT_CHECK, VerifyPool


def overlong_penalty(length: int, max_new_tokens: int, buffer_len: int, factor: float) -> float:
    """DAPO soft overlong punishment (verl's DAPO reward manager): with expected length
    ``E = max_new_tokens - buffer_len``, ``min(0, (E - length) / buffer_len) * factor``; 0 when
    ``buffer_len <= 0``. Zero up to E, then linear down to ``-factor`` at ``max_new_tokens``."""
    if buffer_len <= 0:
        return 0.0
    return min(0.0, (max_new_tokens - buffer_len - length) / buffer_len) * factor


class MathVerifyReward:
    """RewardFn for math with verifiable answers (equations in the module docstring).

    Args: ``correct_reward`` / ``incorrect_reward`` (1.0 / 0.0), ``format_reward`` (0.0: weight of
    the format indicator), ``timeout_s`` (hard deadline per math-verify check, default 1 s), ``num_workers``
    (worker processes), ``max_answer_chars`` (longer extracted answers count as no answer),
    ``overlong_buffer_len`` (0 = penalty off) and ``overlong_penalty_factor`` (1.0, DAPO's value),
    ``memory_mb`` (address-space limit per worker), ``check`` (``"module:function"`` of a
    ``(pred, ref) -> bool`` run in the workers; math-verify by default), ``fast_path`` (False sends
    every extracted answer to the check; for measuring the check alone).
    """

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
        """(correct, format, status) per completion; status is 'fast', 'verified', 'no_answer',
        'error' or 'timeout'."""
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
        try:
            self.close()
        except Exception:
            pass
