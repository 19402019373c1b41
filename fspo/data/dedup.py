"""Problem-text normalisation and de-duplication of the training mix (DAPO-Math-17k + AIME).

Owns: `normalize_problem` (the exact-duplicate key), `content_skeleton` + `NearDuplicateIndex`
(near-duplicate detection by character n-gram containment) and `merge_deduplicated`. Leaves out:
file reading and validation (math_datasets.py).

Two levels, because the same AIME problem appears in DAPO-17k re-typeset (``\\frac85`` vs
``\\frac{8}{5}``, ``$36^{}_{}$`` vs ``$36$``, AoPS signatures such as ``~ momeme``) and often with the
question rewritten to ask for an integer:

1. exact key ``normalize_problem``: lowercase; ``\\dfrac``/``\\tfrac`` -> ``\\frac``; drop ``$``, ``\\[ \\] \\( \\)``,
   LaTeX spacing (``\\, \\; \\: \\! \\quad \\qquad ~``), ``\\left``/``\\right``, ``\\displaystyle``,
   ``\\textstyle``, ``\\text``/``\\mbox``/``\\mathrm`` (keeping their argument), empty groups ``{}`` and
   ``^{}``/``_{}``, and all whitespace. Operators, digits and other commands are kept, so ``x+y``
   and ``x-y`` stay different problems. Used for duplicates inside and across sources.
2. near-duplicate of a secondary (AIME) problem A against primary (DAPO) prompts D:
   skeleton = lowercase text without ``[asy]`` blocks, LaTeX command names and anything but letters
   and digits; containment(A, D) = |grams16(A) & grams16(D)| / |grams16(A)|.  A is a duplicate when
   containment >= `NEAR_THRESHOLD` (0.7), or >= `NEAR_THRESHOLD_SAME_ANSWER` (0.45) and both
   answers are equal. The thresholds come from the score histogram measured on the real files:
   above 0.7 pairs are the same problem; between 0.45 and 0.7 only pairs with equal answers were.

When duplicates disagree, the first occurrence wins (primary before secondary, file order inside a
source); the counts are returned in `DedupStats`.
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
    """The exact-duplicate key described in the module docstring (level 1)."""
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
    """Index over ``texts``; `best_match` returns (containment score, index) of the closest text.

    Grams are indexed every `_INDEX_STRIDE` positions, so any shared run of
    ``GRAM + _INDEX_STRIDE - 1`` skeleton characters finds the candidate; the top candidates by
    hit count are then scored exactly. Returns (0.0, -1) when nothing is shared.
    """

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


def merge_deduplicated(primary: Sequence[Record], secondary: Sequence[Record],
                       near: bool = True) -> Tuple[List[Record], DedupStats]:
    """Primary records without exact duplicates, then secondary records that are neither exact nor
    (when ``near``) near duplicates of a kept primary record. Order is preserved."""
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
    index = NearDuplicateIndex([r.problem for r in kept]) if near and secondary else None
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
