"""Benchmark evaluation: sample k completions per problem, verify them, reduce. With problems p = 1..P, k_p
samples each, c_p correct (the reward's ``correct`` component is 1, else score > 0):

    avg_at_k  = (1/P) sum_p c_p / k_p   (the paper's Avg@8 / Avg@32)     pass_at_k = (1/P) sum_p 1[c_p > 0]

plus ``overlong_rate``, ``response_len_mean`` and ``answered_rate`` (an extractable answer) over all samples.
"""
from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Dict, List, Optional, Sequence

from fspo.rollout.base import SamplingConfig

log = logging.getLogger(__name__)


def avg_at_k(n_correct: Sequence[int], k: Sequence[int] | int) -> float:
    """Mean over problems of ``n_correct[p] / k[p]`` (``k`` an int or one per problem)."""
    ks = [k] * len(n_correct) if isinstance(k, int) else list(k)
    if len(ks) != len(n_correct) or not n_correct:
        raise ValueError(f"avg_at_k needs one k per problem and >= 1 problem (got {len(n_correct)} / {len(ks)})")
    return sum(c / kk for c, kk in zip(n_correct, ks)) / len(n_correct)


@dataclass
class ProblemResult:
    """One problem's row of the per-problem table."""

    problem_id: str
    reference: str
    k: int
    n_correct: int
    accuracy: float
    mean_response_len: float
    n_overlong: int
    n_answered: int


@dataclass
class BenchmarkResult:
    """All problems of one benchmark plus run facts; `metrics` gives the logged scalars."""

    name: str
    problems: List[ProblemResult]
    max_new_tokens: int
    skipped_prompts: int = 0
    seconds: float = 0.0
    completions: List[dict] = field(default_factory=list)  # filled when keep_completions=True

    def metrics(self) -> Dict[str, float]:
        """The logged scalars (module docstring)."""
        ps = self.problems
        n = sum(p.k for p in ps)
        tokens = sum(p.mean_response_len * p.k for p in ps)
        return {"avg_at_k": avg_at_k([p.n_correct for p in ps], [p.k for p in ps]),
                "pass_at_k": sum(p.n_correct > 0 for p in ps) / len(ps),
                "overlong_rate": sum(p.n_overlong for p in ps) / n,
                "response_len_mean": tokens / n,
                "answered_rate": sum(p.n_answered for p in ps) / n,
                "n_problems": float(len(ps)), "k": float(max(p.k for p in ps)),
                "skipped_prompts": float(self.skipped_prompts), "max_new_tokens": float(self.max_new_tokens),
                "seconds": self.seconds, "tokens_per_s": tokens / max(self.seconds, 1e-9)}

    def table(self) -> Dict[str, list]:
        """The per-problem rows as columns."""
        rows = [asdict(p) for p in self.problems]
        return {key: [r[key] for r in rows] for key in rows[0]} if rows else {}


def context_length(policy, engine) -> Optional[int]:
    """Longest prompt + completion the model and engine accept; None when neither is known."""
    limits = [getattr(getattr(policy, "config", None), "max_position_embeddings", None),
              getattr(engine, "max_model_len", None)]
    limits = [int(x) for x in limits if x]
    return min(limits) if limits else None


def duration(seconds: float) -> str:
    """``seconds`` for a person: ``42 s``, ``3 min 05 s``, ``1 h 02 min``."""
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def evaluate_benchmark(name: str, source, k: int, engine, tokenizer, reward_fn, sampling: SamplingConfig, *,
                       context_len: Optional[int] = None, max_prompt_len: Optional[int] = None,
                       on_long_prompt: str = "raise", fit_context: bool = True, prompts_per_call: Optional[int] = 64,
                       seed: int = 0, keep_completions: bool = False, label: str = "") -> BenchmarkResult:
    """Sample ``k`` completions for every prompt of ``source`` with ``engine`` and score them with ``reward_fn``.
    Prompts over ``max_prompt_len`` raise or are skipped (``on_long_prompt``); a budget over ``context_len`` is
    lowered (``fit_context``) or raises. Engine call j uses seed ``seed + j``. One progress line per call."""
    if k < 1:
        raise ValueError(f"samples per prompt (k) must be >= 1 for {name}, got {k}")
    samples, ids = _kept_prompts(name, source, tokenizer, max_prompt_len, on_long_prompt)
    new_tokens = _fit_new_tokens(name, max(len(x) for x in ids), sampling.max_new_tokens, context_len, fit_context)
    params = replace(sampling, n=k, max_new_tokens=new_tokens)
    step = prompts_per_call or len(ids)
    problems: List[ProblemResult] = []
    completions: List[dict] = []
    t0 = time.perf_counter()
    for call, start in enumerate(range(0, len(ids), step)):
        chunk = samples[start:start + step]
        rollout = engine.generate(ids[start:start + step], replace(params, seed=seed + call))
        texts = tokenizer.batch_decode(rollout.response_ids, skip_special_tokens=True)
        groups = [int(g) for g in rollout.group_ids]
        lengths, overlong = rollout.lengths.tolist(), [bool(o) for o in rollout.overlong]
        out = reward_fn(texts, [chunk[g].answer for g in groups], lengths, overlong, new_tokens)
        correct = out.components.get("correct") or [float(s > 0) for s in out.scores]
        answered = out.components.get("format") or [1.0] * len(texts)
        for j, sample in enumerate(chunk):
            rows = [i for i, g in enumerate(groups) if g == j]
            n_ok = int(sum(correct[i] > 0.5 for i in rows))
            problems.append(ProblemResult(
                problem_id=str(sample.meta.get("id", start + j)), reference=sample.answer, k=len(rows),
                n_correct=n_ok, accuracy=n_ok / max(len(rows), 1),
                mean_response_len=sum(lengths[i] for i in rows) / max(len(rows), 1),
                n_overlong=sum(overlong[i] for i in rows), n_answered=int(sum(answered[i] > 0.5 for i in rows))))
            if keep_completions:
                completions += [{"problem_id": problems[-1].problem_id, "completion": texts[i],
                                 "correct": bool(correct[i] > 0.5), "length": lengths[i],
                                 "overlong": overlong[i]} for i in rows]
        spent = time.perf_counter() - t0
        rest = spent / len(problems) * (len(ids) - len(problems))
        log.info("%s%s: %d/%d problems x %d samples, %s%s", f"{label} " if label else "", name, len(problems),
                 len(ids), k, duration(spent), f", ETA {duration(rest)}" if rest > 0 else "")
    return BenchmarkResult(name=name, problems=problems, max_new_tokens=new_tokens,
                           skipped_prompts=len(source) - len(samples),
                           seconds=time.perf_counter() - t0, completions=completions)


def check_fits_context(name: str, source, tokenizer, max_new_tokens: int, context_len: Optional[int], *,
                       max_prompt_len: Optional[int] = None, on_long_prompt: str = "raise",
                       fit_context: bool = True) -> int:
    """Raise ValueError, before anything is sampled, when benchmark ``name`` cannot run (the rules of
    `evaluate_benchmark`); return the new-token budget it will use."""
    _, ids = _kept_prompts(name, source, tokenizer, max_prompt_len, on_long_prompt)
    return _fit_new_tokens(name, max(len(x) for x in ids), max_new_tokens, context_len, fit_context, warn=False)


def _kept_prompts(name: str, source, tokenizer, max_prompt_len: Optional[int], on_long_prompt: str):
    """(samples, prompt token ids) of ``source`` after the max_prompt_len rule."""
    if on_long_prompt not in ("raise", "skip"):
        raise ValueError(f"on_long_prompt must be 'raise' or 'skip', got {on_long_prompt!r}")
    samples = [source[i] for i in range(len(source))]
    ids = tokenizer([s.prompt for s in samples], add_special_tokens=False)["input_ids"]
    keep = [i for i, x in enumerate(ids) if max_prompt_len is None or len(x) <= max_prompt_len]
    if len(keep) < len(ids) and on_long_prompt == "raise":
        worst = max(len(x) for x in ids)
        raise ValueError(f"{name}: {len(ids) - len(keep)} prompts exceed max_prompt_len={max_prompt_len} tokens "
                         f"(longest {worst}): raise max_prompt_len or set on_long_prompt=skip")
    if not keep:
        raise ValueError(f"{name}: every prompt is longer than max_prompt_len={max_prompt_len} tokens")
    return [samples[i] for i in keep], [ids[i] for i in keep]


def _fit_new_tokens(name: str, longest: int, wanted: int, context_len: Optional[int], fit: bool,
                    warn: bool = True) -> int:
    if context_len is None or longest + wanted <= context_len:
        return wanted
    room = context_len - longest
    if room < 1:
        raise ValueError(f"benchmark {name} does not fit the model: its longest prompt is {longest} tokens and the "
                         f"model's context is {context_len} (prompt + at least 1 new token must fit): choose other "
                         f"benchmarks (eval_data=[...], e.g. eval_data=[arithmetic] for the built-in task), a model "
                         f"with a longer context, or max_prompt_len={context_len - 1} on_long_prompt=skip")
    if not fit:
        raise ValueError(f"{name}: longest prompt ({longest} tokens) + max_new_tokens ({wanted}) exceeds the "
                         f"model's context ({context_len}): lower sampling.max_new_tokens or set fit_context=true")
    if warn:
        log.warning("%s: max_new_tokens lowered from %d to %d to fit the model's context of %d tokens",
                    name, wanted, room, context_len)
    return room
