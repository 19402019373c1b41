"""Agreement of the math reward with the references of the evaluation sets.

For every row of MATH500, AIME24, AIME25 and GSM8K, four completions are scored with
`MathVerifyReward`:

    positive, boxed:   "...so the answer is $\\boxed{REF}$."        -> must be correct
    positive, answer:  "...\\nAnswer: REF"                           -> must be correct
    negative, boxed / answer: the same with OTHER, the reference of the next row whose answer is
                       not equivalent (canonical string / plain-number comparison)  -> must be incorrect

Agreement = share of the four verdicts that match (goal: >= 99.5% overall). Checks per second =
completions scored / wall time of the reward calls (batches of ``--batch`` completions, like a
rollout step; includes the fast path). Prints a table and writes JSON (``--out``).

    .venv/bin/python benchmarks/verify_agreement.py [--data-dir DIR] [--limit N] [--out PATH]
"""
from __future__ import annotations

import argparse
import re
import time
from typing import Dict, List, Optional, Sequence

from _common import write_json

from fspo.data.math_datasets import EVAL_SETS, load_math_source
from fspo.rewards.answer_extraction import canonical, fast_equal
from fspo.rewards.math_verify_reward import MathVerifyReward

FORMS = {
    "boxed": "Let me work through the problem step by step.\nAfter simplifying, so the answer is $\\boxed{{{a}}}$.",
    "answer": "Let me work through the problem step by step.\nAfter simplifying, we are done.\nAnswer: {a}",
}


_VAR = re.compile(r"^\s*[a-zA-Z]\s*=\s*")


def _equivalent(a: str, b: str) -> bool:
    """Cheap equivalence used only to pick negatives: canonical strings / plain numbers, ignoring a
    leading ``x =`` (the verifier rightly accepts ``x=5`` for 5)."""
    a, b = _VAR.sub("", a), _VAR.sub("", b)
    return canonical(a) == canonical(b) or bool(fast_equal(a, b))


def other_answer(answers: Sequence[str], i: int) -> Optional[str]:
    """The reference of the first row after ``i`` (cyclically) that is not equivalent to row i's."""
    n = len(answers)
    for k in range(1, n):
        cand = answers[(i + k) % n]
        if not _equivalent(cand, answers[i]):
            return cand
    return None


def agreement(name: str, reward: MathVerifyReward, data_dir: Optional[str] = None, limit: Optional[int] = None,
              batch: int = 256) -> Dict:
    """Score the four completions per row of dataset ``name``; return counts, agreement and failures."""
    refs = [s.answer for s in load_math_source(name, data_dir=data_dir, template="raw", limit=limit)]
    items = []  # (row, kind, form, completion, reference, expected)
    for i, ref in enumerate(refs):
        other = other_answer(refs, i)
        for form, tpl in FORMS.items():
            items.append((i, "positive", form, tpl.format(a=ref), ref, 1.0))
            if other is not None:
                items.append((i, "negative", form, tpl.format(a=other), ref, 0.0))
    got: List[float] = []
    stats = {"fast": 0, "verified": 0, "no_answer": 0, "error": 0, "timeout": 0}
    t0 = time.perf_counter()
    for b in range(0, len(items), batch):
        chunk = items[b:b + batch]
        out = reward([c[3] for c in chunk], [c[4] for c in chunk], [1] * len(chunk), [False] * len(chunk), 1024)
        got += out.components["correct"]
        for k, v in reward.last_stats.items():
            stats[k] += v
    seconds = time.perf_counter() - t0
    fails = [dict(row=c[0], kind=c[1], form=c[2], reference=c[4], completion_answer=c[3].rsplit("\n", 1)[-1][-120:])
             for c, g in zip(items, got) if g != c[5]]
    pos = [g == c[5] for c, g in zip(items, got) if c[1] == "positive"]
    neg = [g == c[5] for c, g in zip(items, got) if c[1] == "negative"]
    return dict(rows=len(refs), checks=len(items), agree=len(items) - len(fails),
                agreement_pct=100.0 * (len(items) - len(fails)) / len(items),
                positive_pct=100.0 * sum(pos) / max(1, len(pos)), negative_pct=100.0 * sum(neg) / max(1, len(neg)),
                seconds=seconds, checks_per_s=len(items) / seconds, **stats, failures=fails)


def main(argv: Optional[Sequence[str]] = None) -> Dict:
    """Run `agreement` on the chosen datasets, print the table and write the JSON summary."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", default=None, help="data directory (default: FSPO_DATA_DIR or ../shared/data)")
    ap.add_argument("--datasets", nargs="+", default=list(EVAL_SETS), choices=list(EVAL_SETS))
    ap.add_argument("--limit", type=int, default=None, help="first N rows per dataset")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--timeout-s", type=float, default=1.0)
    ap.add_argument("--num-workers", type=int, default=2)
    ap.add_argument("--no-fast-path", action="store_true", help="send every answer to math-verify")
    ap.add_argument("--out", default=".bench/verify_agreement.json")
    args = ap.parse_args(argv)
    reward = MathVerifyReward(timeout_s=args.timeout_s, num_workers=args.num_workers,
                              fast_path=not args.no_fast_path)
    t0 = time.perf_counter()
    reward.pool.start()
    startup = time.perf_counter() - t0
    per = {name: agreement(name, reward, args.data_dir, args.limit, args.batch) for name in args.datasets}
    reward.close()
    checks, agree = sum(r["checks"] for r in per.values()), sum(r["agree"] for r in per.values())
    seconds = sum(r["seconds"] for r in per.values())
    summary = dict(overall_agreement_pct=100.0 * agree / checks, checks=checks, seconds=seconds,
                   checks_per_s=checks / seconds, worker_startup_s=startup, timeout_s=args.timeout_s,
                   num_workers=args.num_workers, fast_path=not args.no_fast_path, datasets=per)
    print(f"{'dataset':10s} {'rows':>5s} {'checks':>6s} {'agree%':>7s} {'pos%':>7s} {'neg%':>7s} "
          f"{'checks/s':>8s} {'fast':>5s} {'mv':>5s} {'t/o':>4s} {'err':>4s}")
    for name, r in per.items():
        print(f"{name:10s} {r['rows']:5d} {r['checks']:6d} {r['agreement_pct']:7.2f} {r['positive_pct']:7.2f} "
              f"{r['negative_pct']:7.2f} {r['checks_per_s']:8.1f} {r['fast']:5d} {r['verified']:5d} "
              f"{r['timeout']:4d} {r['error']:4d}")
    print(f"overall agreement {summary['overall_agreement_pct']:.2f}% over {checks} checks, "
          f"{summary['checks_per_s']:.1f} checks/s ({args.num_workers} workers, startup {startup:.2f}s)")
    for name, r in per.items():
        for f in r["failures"][:10]:
            print(f"  FAIL {name} {f}")
    write_json(args.out, summary)
    return summary


if __name__ == "__main__":
    main()
