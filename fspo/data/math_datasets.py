"""The paper's math prompt sets: DAPO-Math-17k + AIME 1983-2023 for training, MATH500 / AIME24 / AIME25 (and
GSM8K) for evaluation; `load_math_source` is the Hydra entry point.

Every loader returns a `ListSource` of ``Sample(prompt=render(template, problem), answer=reference,
meta={"source", "row", "id"})`` with ``.stats`` (rows read, bad rows skipped, de-duplication counts):

| name            | file(s)                                     | problem / reference                             |
|-----------------|---------------------------------------------|-------------------------------------------------|
| dapo_aime_train | dapo_math_17k.parquet + aime_1983_2023.json | prompt[0].content / reward_model.ground_truth;  |
|                 |                                             | problem / answer (as int)                       |
| math500         | math500_test.jsonl                          | problem / answer (LaTeX)                        |
| aime24          | aime2024_test.jsonl                         | problem / answer ("025" -> "25")                |
| aime25          | aime2025_test.jsonl                         | prompt minus the boxed instruction / answer     |
| gsm8k           | gsm8k_test.jsonl                            | question / text after "#### ", commas removed   |

Row order: file order (DAPO rows, then the AIME rows that survive de-duplication); ``shuffle=True`` permutes
with ``seed``; ``limit`` then keeps the first N.
"""
from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from fspo.data.base import ListSource, Sample
from fspo.data.dedup import DedupStats, Record, merge_deduplicated
from fspo.data.math_io import ON_BAD_ROW, BadRow, RowCollector, open_source, require_str, resolve_data_dir
from fspo.data.templates import BOXED_INSTRUCTION, render

_DAPO_HEAD = "Solve the following math problem step by step."
_DAPO_TAIL = "Remember to put your answer on its own line after"


def _int_answer(ans: str) -> str:
    """AIME answers are integers 0..999; "025" -> "25". Non-integers are kept as they are."""
    return str(int(ans)) if ans.lstrip("+-").isdigit() else ans


def _strip_dapo_template(text: str) -> str:
    """The bare problem from a hub DAPO prompt (local files already have the template removed)."""
    if text.startswith(_DAPO_HEAD) and _DAPO_TAIL in text:
        body = text.split("\n\n", 1)[1] if "\n\n" in text else text
        return body.rsplit(_DAPO_TAIL, 1)[0].strip()
    return text


def _dapo(i: int, row: Any) -> Record:
    msgs = row.get("prompt") if isinstance(row, dict) else None
    if not isinstance(msgs, list) or not msgs:
        raise BadRow("prompt", "must be a non-empty list of {content, role} messages")
    problem = _strip_dapo_template(require_str(msgs[0], "content", name="prompt[0].content"))
    answer = require_str(row.get("reward_model"), "ground_truth", allow_int=True,
                         name="reward_model.ground_truth")
    extra = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
    return Record(problem, answer, {"source": "dapo_math_17k", "row": i, "id": f"dapo-{extra.get('index', i)}"})


def _aime_hist(i: int, row: Any) -> Record:
    problem, answer = require_str(row, "problem"), require_str(row, "answer", allow_int=True)
    pid = f"aime-{row.get('year')}-{row.get('aime_number')}-{row.get('problem_number')}"
    return Record(problem, _int_answer(answer), {"source": "aime_1983_2023", "row": i, "id": pid})


def _math500(i: int, row: Any) -> Record:
    problem, answer = require_str(row, "problem"), require_str(row, "answer", allow_int=True)
    pid = row.get("unique_id") if isinstance(row.get("unique_id"), str) else f"math500-{i}"
    return Record(problem, answer, {"source": "math500", "row": i, "id": pid})


def _aime24(i: int, row: Any) -> Record:
    problem, answer = require_str(row, "problem"), require_str(row, "answer", allow_int=True)
    return Record(problem, _int_answer(answer), {"source": "aime24", "row": i, "id": f"aime24-{row.get('id', i)}"})


def _aime25(i: int, row: Any) -> Record:
    prompt, answer = require_str(row, "prompt"), require_str(row, "answer", allow_int=True)
    problem = prompt[: -len(BOXED_INSTRUCTION)].rstrip() if prompt.endswith(BOXED_INSTRUCTION) else prompt
    if not problem:
        raise BadRow("prompt", "holds only the instruction, no problem")
    return Record(problem, _int_answer(answer), {"source": "aime25", "row": i, "id": f"aime25-{i}"})


def _gsm8k(i: int, row: Any) -> Record:
    problem, solution = require_str(row, "question"), require_str(row, "answer")
    if "#### " not in solution:
        raise BadRow("answer", "has no final answer after '#### '")
    answer = solution.rsplit("#### ", 1)[1].strip().replace(",", "")
    if not answer:
        raise BadRow("answer", "is empty after '#### '")
    return Record(problem, answer, {"source": "gsm8k", "row": i, "id": f"gsm8k-{i}"})


@dataclass(frozen=True)
class _File:
    filename: str
    extract: Callable[[int, Any], Record]
    hub: Optional[Tuple[str, Optional[str], str]] = None  # (hub id, config, split)


FILES: Dict[str, _File] = {
    "dapo_math_17k": _File("dapo_math_17k.parquet", _dapo, ("BytedTsinghua-SIA/DAPO-Math-17k", None, "train")),
    "aime_1983_2023": _File("aime_1983_2023.json", _aime_hist),
    "math500": _File("math500_test.jsonl", _math500, ("HuggingFaceH4/MATH-500", None, "test")),
    "aime24": _File("aime2024_test.jsonl", _aime24),
    "aime25": _File("aime2025_test.jsonl", _aime25),
    "gsm8k": _File("gsm8k_test.jsonl", _gsm8k, ("openai/gsm8k", "main", "test")),
}
TRAIN_SETS = {"dapo_aime_train": ("dapo_math_17k", "aime_1983_2023")}
EVAL_SETS = ("math500", "aime24", "aime25", "gsm8k")
NAMES = tuple(TRAIN_SETS) + EVAL_SETS


def read_records(key: str, data_dir: Optional[str] = None, on_bad_row: str = "raise") -> Tuple[List[Record], int]:
    """Validated records of one file in `FILES` (before templating) and the number of skipped rows."""
    spec = FILES[key]
    label, rows = open_source(resolve_data_dir(data_dir), spec.filename, spec.hub)
    collector = RowCollector(label, on_bad_row)
    return collector.collect(rows, spec.extract), collector.skipped


def load_math_source(name: str, data_dir: Optional[str] = None, template: str = "boxed",
                     split: Optional[str] = None, limit: Optional[int] = None, shuffle: bool = False,
                     seed: int = 0, on_bad_row: str = "raise", dedup: bool = True) -> ListSource:
    """The prompt source ``name``: ``dapo_aime_train`` (split 'train') or one of `EVAL_SETS` (split 'test');
    ``on_bad_row``: 'raise' or 'skip'; ``dedup`` (training only): drop duplicate problems (dedup.py)."""
    if name not in NAMES:
        raise ValueError(f"unknown math dataset {name!r}: choose one of {list(NAMES)} (data.name)")
    expected = "train" if name in TRAIN_SETS else "test"
    if split not in (None, expected):
        raise ValueError(f"math dataset {name!r} has only the split {expected!r}, got split={split!r}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive integer or null, got {limit!r}")
    if on_bad_row not in ON_BAD_ROW:
        raise ValueError(f"on_bad_row must be one of {ON_BAD_ROW}, got {on_bad_row!r}")
    render(template, "")  # fail fast on an unknown template, before reading any file
    stats: Dict[str, Any] = {"skipped": 0}
    if name in TRAIN_SETS:
        primary_key, secondary_key = TRAIN_SETS[name]
        primary, s1 = read_records(primary_key, data_dir, on_bad_row)
        secondary, s2 = read_records(secondary_key, data_dir, on_bad_row)
        stats.update(rows_read=len(primary) + len(secondary) + s1 + s2, skipped=s1 + s2)
        if dedup:
            records, dstats = merge_deduplicated(primary, secondary)
        else:
            records, dstats = list(primary) + list(secondary), DedupStats(kept=len(primary) + len(secondary))
        stats["dedup"] = {k: v for k, v in asdict(dstats).items() if k != "near_pairs"}
    else:
        records, skipped = read_records(name, data_dir, on_bad_row)
        stats.update(rows_read=len(records) + skipped, skipped=skipped)
    if shuffle:
        records = list(records)
        random.Random(seed).shuffle(records)
    if limit is not None:
        records = records[:limit]
    samples = [Sample(prompt=render(template, r.problem), answer=r.answer, meta=dict(r.meta)) for r in records]
    source = ListSource(samples, name=name)
    source.stats = stats
    return source

