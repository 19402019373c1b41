"""Calling a reward function safely, and stopping a run whose rewards cannot teach anything.

Per training step, over all of its samples (summed over ranks, so every rank stops together):
- any non-finite score stops the run with a line naming the reward;
- a reward that fails on EVERY sample (raises, or reports every sample in ``errors``) stops the run;
- a reward that raises on some samples: those score 0, are counted (``reward/errors``, ``reward/raised``) and
  warned about; the run stops when the raised fraction exceeds ``reward_guard.max_error_frac``.
  Errors a reward reports itself (a verifier timeout scored 0) do not count against the threshold.
"""
from __future__ import annotations

import logging
import math
from typing import List

from fspo.rewards.base import RewardOutput

log = logging.getLogger(__name__)


class RewardFailure(ValueError):
    """The step's rewards cannot train: non-finite, failing on every sample, or raising too often."""


def reward_name(reward_fn) -> str:
    """``module.Class`` of a reward object (``module.function`` for a plain function)."""
    obj = reward_fn if callable(reward_fn) and hasattr(reward_fn, "__qualname__") else type(reward_fn)
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def guarded_reward(reward_fn, texts: List[str], refs: List[str], lengths: List[int], overlong: List[bool],
                   max_new_tokens: int) -> RewardOutput:
    """``reward_fn`` on the batch: if the call raises (or returns the wrong number of scores) each sample is
    scored alone, a raising one scoring 0 (counted in ``errors`` and the ``raised`` component); a non-finite
    score becomes 0, flagged in the ``nonfinite`` component."""
    n = len(texts)
    raised = [0.0] * n
    try:
        out = reward_fn(texts, refs, lengths, overlong, max_new_tokens)
        if len(out.scores) != n:
            raise ValueError(f"reward function returned {len(out.scores)} scores for {n} completions")
        scores, comps, errors = [float(x) for x in out.scores], dict(out.components), int(out.errors)
    except Exception as e:  # noqa: BLE001 - find the samples that fail
        log.warning("reward %s failed on the batch (%s: %s); scoring samples one by one", reward_name(reward_fn),
                    type(e).__name__, e)
        scores, rows, errors = [], [], 0
        for i in range(n):
            try:
                o = reward_fn(texts[i:i + 1], refs[i:i + 1], lengths[i:i + 1], overlong[i:i + 1], max_new_tokens)
                scores.append(float(o.scores[0]))
                rows.append({k: float(v[0]) for k, v in o.components.items()})
                errors += int(o.errors)
            except Exception as e1:  # noqa: BLE001
                if not any(raised):
                    log.warning("reward %s raised on sample %d: %s: %s", reward_name(reward_fn), i,
                                type(e1).__name__, str(e1)[:200])
                scores.append(0.0)
                rows.append({})
                errors += 1
                raised[i] = 1.0
        comps = {k: [r.get(k, 0.0) for r in rows] for k in sorted({k for r in rows for k in r})}
    bad = [not math.isfinite(x) for x in scores]
    comps["nonfinite"] = [float(b) for b in bad]
    comps["raised"] = raised
    return RewardOutput(scores=[0.0 if b else x for x, b in zip(scores, bad)], components=comps, errors=errors)


def check_reward_health(name: str, step: int, n: float, nonfinite: float, raised: float, errors: float,
                        max_error_frac: float = 0.0) -> None:
    """Raise `RewardFailure` per the policy above; ``n``: samples of the step, the other counts over them."""
    if n <= 0:
        return
    if nonfinite:
        raise RewardFailure(f"reward {name} returned a non-finite score (NaN or inf) for {nonfinite:g} of {n:g} "
                            f"samples at step {step}: rewards must be finite numbers; check the reward's settings "
                            f"(reward.*, e.g. reward.correct_reward) or the reward function")
    if errors >= n:
        raise RewardFailure(f"reward {name} failed on every one of the {n:g} samples at step {step} (all scored 0, "
                            f"so nothing can learn): see the warning above for its error; fix the reward or the "
                            f"data's references")
    if raised / n > max_error_frac:
        raise RewardFailure(f"reward {name} raised on {raised:g} of {n:g} samples at step {step} ({raised / n:.1%}), "
                            f"above reward_guard.max_error_frac={max_error_frac:g}: fix the reward, or set "
                            f"reward_guard.max_error_frac={min(1.0, math.ceil(100 * raised / n) / 100):g} to score "
                            f"such samples 0 and go on")
    if raised:
        log.warning("reward %s raised on %g of %g samples at step %d: scored 0 (reward/errors, reward/raised)",
                    name, raised, n, step)
