"""Problem-text normalisation and de-duplication of the training mix (DAPO-Math-17k + AIME), whose AIME problems
reappear in DAPO-17k re-typeset and often reworded:

1. exact key `normalize_problem`: lowercase, ``\\dfrac``/``\\tfrac`` -> ``\\frac``, math delimiters, LaTeX spacing,
   sizing and text commands, empty groups and whitespace dropped (operators and digits kept);
2. near duplicate of a secondary (AIME) problem A against primary (DAPO) prompts D: on skeletons (letters and
   digits, no ``[asy]`` or command names), containment(A, D) = |grams16(A) & grams16(D)| / |grams16(A)| >= 0.7,
   or >= 0.45 with equal answers (the thresholds from the score histogram on the real files).

The first occurrence wins (primary before secondary); the counts are returned in `DedupStats`.
"""
from __future__ import annotations

import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Dict, List, NamedTuple, Sequence, Set, Tuple

NEAR_THRESHOLD = 0.7
NEAR_THRESHOLD_SAME_ANSWER = 0.45
GRAM = 16
_INDEX_STRIDE = 8
_CANDIDATES = 5

_DROP = re.compile(
    r"\\(?:quad|qquad|left|right|displaystyle|textstyle|text|mbox|mathrm)(?![a-zA-Z])"
    r"|\\[,;:! \[\]()]|[_^]\{\}|\{\}|~|\$|\s+")
_ASY = re.compile(r"\[asy\].*?(?:\[/asy\]|$)", re.S)
_CMD = re.compile(r"\\[a-z]+")
_NON_ALNUM = re.compile(r"[\W_]+")
_INT = re.compile(r"^\s*[+-]?\d+\s*$")


class Record(NamedTuple):
    """A validated problem before templating: bare ``problem`` text, reference ``answer``, ``meta``."""

    problem: str
    answer: str
    meta: Dict[str, Any]


@dataclass
class DedupStats:
    """Counts from `merge_deduplicated` (all are numbers of dropped rows, except ``kept``)."""

    kept: int = 0
    primary_exact: int = 0
    secondary_exact: int = 0
    secondary_near: int = 0
    conflicting_answers: int = 0
    near_pairs: List[Tuple[int, int, float]] = field(default_factory=list)  # (sec row, prim row, score)


def normalize_problem(text: str) -> str:
    """The exact-duplicate key (level 1)."""
    s = text.lower().replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    prev = None
    while prev != s:  # removing "{}" can expose new empty groups, e.g. "^{{}}"
        prev, s = s, _DROP.sub("", s)
    return s


def content_skeleton(text: str) -> str:
    """Letters and digits only (any script), after dropping ``[asy]`` blocks and LaTeX commands."""
    s = _ASY.sub("", text.lower())
    return _NON_ALNUM.sub("", _CMD.sub("", s))


def _grams(s: str) -> Set[str]:
    return {s[i:i + GRAM] for i in range(max(1, len(s) - GRAM + 1))}


def same_answer(a: str, b: str) -> bool:
    """Integer equality when both are integers ("025" == "25"), else equality of stripped strings."""
    if _INT.match(a) and _INT.match(b):
        return int(a) == int(b)
    return a.strip() == b.strip()


class NearDuplicateIndex:
    """Index over ``texts``, grams every `_INDEX_STRIDE` positions (any shared run of ``GRAM + _INDEX_STRIDE - 1``
    skeleton characters finds the candidate); the top candidates by hits are scored exactly."""

    def __init__(self, texts: Sequence[str]):
        self.skeletons = [content_skeleton(t) for t in texts]
        self.index: Dict[str, List[int]] = defaultdict(list)
        for j, s in enumerate(self.skeletons):
            for i in range(0, max(1, len(s) - GRAM + 1), _INDEX_STRIDE):
                self.index[s[i:i + GRAM]].append(j)

    def best_match(self, text: str) -> Tuple[float, int]:
        """(containment of ``text``'s grams in the best indexed text, its index); (0.0, -1) if none."""
        grams = _grams(content_skeleton(text))
        hits: Counter = Counter()
        for g in grams:
            hits.update(self.index.get(g, ()))
        best = (0.0, -1)
        for j, _ in hits.most_common(_CANDIDATES):
            score = len(grams & _grams(self.skeletons[j])) / len(grams)
            if score > best[0]:
                best = (score, j)
        return best


def merge_deduplicated(primary: Sequence[Record], secondary: Sequence[Record]) -> Tuple[List[Record], DedupStats]:
    """Primary records without exact duplicates, then secondary records that are neither exact nor near
    duplicates of a kept primary record. Order is preserved."""
    stats = DedupStats()
    kept: List[Record] = []
    seen: Dict[str, int] = {}
    for r in primary:
        key = normalize_problem(r.problem)
        if key in seen:
            stats.primary_exact += 1
            stats.conflicting_answers += not same_answer(kept[seen[key]].answer, r.answer)
            continue
        seen[key] = len(kept)
        kept.append(r)
    index = NearDuplicateIndex([r.problem for r in kept]) if secondary else None
    for row, r in enumerate(secondary):
        key = normalize_problem(r.problem)
        if key in seen:
            stats.secondary_exact += 1
            stats.conflicting_answers += not same_answer(kept[seen[key]].answer, r.answer)
            continue
        if index is not None:
            score, j = index.best_match(r.problem)
            if j >= 0 and (score >= NEAR_THRESHOLD or (
                    score >= NEAR_THRESHOLD_SAME_ANSWER and same_answer(kept[j].answer, r.answer))):
                stats.secondary_near += 1
                stats.near_pairs.append((row, j, score))
                continue
        seen[key] = len(kept)
        kept.append(r)
    stats.kept = len(kept)
    return kept, stats
