"""Calling a reward function safely, and stopping a run whose rewards cannot teach anything.

Owns: `guarded_reward` (the reward on a batch: a raising call is retried sample by sample, a raising
sample scores 0; non-finite scores become 0 and are flagged), `reward_name`, `check_reward_health` and
`RewardFailure`. Leaves out: the reward functions themselves (this package's other modules) and where
the step's counts are summed over data-parallel ranks (fspo/rollout/callback.py, which calls
`check_reward_health` on the summed counts so that every rank stops together).

Policy, per training step, over all of the step's samples:
- any non-finite score (NaN, +-inf) stops the run at once with a line naming the reward: a NaN reward
  zeroed silently trains on nothing;
- a reward that fails on EVERY sample (raises, or reports every sample in ``RewardOutput.errors``)
  stops the run: all scores would be 0 and every advantage 0;
- a reward that raises on some samples: those score 0, are counted (``reward/errors``, and
  ``reward/raised``: the fraction of samples whose call raised) and warned about; the run stops when that
  fraction exceeds ``reward_guard.max_error_frac`` (default 0: any raising sample stops the run;
  0.05 tolerates one in twenty). Errors a reward reports itself (a verifier timeout scored 0) are
  counted but do not count against the threshold.
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
    """``reward_fn`` on the batch, made safe for the update: if the call raises (or returns the wrong
    number of scores) each sample is scored alone and a sample whose call raises scores 0 and counts
    in ``errors`` and in the ``raised`` component (1 per such sample); a non-finite score becomes 0 and
    is flagged in the ``nonfinite`` component. `check_reward_health` decides whether the run goes on."""
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
    """Raise `RewardFailure` per the module docstring's policy; ``n``: samples of the step, the other
    counts over them (summed over ranks); warns when some samples raised within the threshold."""
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
