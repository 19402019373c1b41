"""What evaluate says while it works and where it writes: progress with an ETA, one unit, ``eval`` once.

Owns: a progress line per engine call naming the model, the benchmark, problems done of total and an ETA;
`duration`'s wording; ``summary.md`` in fractions (0-1, the unit of the MLflow metrics and the console, not
percent); the local copies of ``eval/...`` artifacts directly in the evaluation's folder
(``<run>/eval/<date_time>/summary.md``). Leaves out: Avg@k itself (test_evaluate.py).
"""
from __future__ import annotations

import logging

from test_evaluate import ParityReward, ScriptedEngine

from fspo.data.base import ListSource, Sample
from fspo.evaluation.benchmark import duration, evaluate_benchmark
from fspo.evaluation.summary import MlflowRecorder, summarize, summary_markdown
from fspo.models.tiny import build_tokenizer
from fspo.rollout.base import SamplingConfig


def test_each_engine_call_logs_progress_with_an_eta(caplog):
    tok = build_tokenizer()
    source = ListSource([Sample(f"Q{i}", "1", {"id": f"p{i}"}) for i in range(4)])
    engine = ScriptedEngine([["abc", "ab"] for _ in range(4)])
    engine.setup(None, tok, "")
    with caplog.at_level(logging.INFO, logger="fspo.evaluation.benchmark"):
        evaluate_benchmark("toy", source, 2, engine, tok, ParityReward(), SamplingConfig(n=1, max_new_tokens=8),
                           prompts_per_call=2, label="[2/3 step_000040.ckpt]")
    lines = [r.getMessage() for r in caplog.records if "problems" in r.getMessage()]
    assert len(lines) == 2, lines
    assert lines[0].startswith("[2/3 step_000040.ckpt] toy: 2/4 problems x 2 samples, ") and ", ETA " in lines[0]
    assert "4/4 problems" in lines[1] and "ETA" not in lines[1]


def test_durations_read_as_a_person_says_them():
    assert [duration(s) for s in (0.4, 42, 185, 3725)] == ["0 s", "42 s", "3 min 05 s", "1 h 02 min"]


def test_summary_md_speaks_the_unit_of_mlflow_and_the_console():
    e = [{"checkpoint": "s10", "step": 10, "base": False, "metrics": {"a": {"avg_at_k": 0.265625}}}]
    md = summary_markdown(summarize(e))
    assert "| a | - | 0.2656 | 10 | 0.2656 | 10 |" in md and "(fraction correct, 0-1)" in md and "26.56" not in md


def test_local_copies_do_not_repeat_eval(tmp_path):
    rec = MlflowRecorder.__new__(MlflowRecorder)
    rec.out_dir = tmp_path / "run" / "eval" / "2026-01-05_10-00-00"
    assert rec._local("eval/summary.md") == rec.out_dir / "summary.md"
    want = rec.out_dir / "math500" / "step_40" / "per_problem.json"
    assert rec._local("eval/math500/step_40/per_problem.json") == want
