"""Figure 4 of the report (fspo/evaluation/report/difficulty.py): per problem, by difficulty, the overlong rate
and the mean length excluding overlong samples, by hand; read from an evaluate run's MLflow artifacts through
``experiments/report.py --eval-run``; a run that is not an evaluate run is one error line."""
from __future__ import annotations

import csv
import math

import pytest
from test_report import _report, store  # noqa: F401  (the training runs' store fixture)

from fspo.evaluation.report.difficulty import difficulty_rows

# three problems, k = 4 samples each, M = 64: p1 has one overlong sample (length 64) and three of length 20
TABLE = {"problem_id": ["p0", "p1", "p2"], "reference": ["1", "2", "3"], "k": [4, 4, 4], "n_correct": [4, 1, 0],
         "accuracy": [1.0, 0.25, 0.0], "mean_response_len": [10.0, (3 * 20 + 64) / 4, 64.0],
         "n_overlong": [0, 1, 4], "n_answered": [4, 3, 0]}


def test_rows_by_hand():
    rows = difficulty_rows({k: list(reversed(v)) for k, v in TABLE.items()}, 64)  # order of the table is irrelevant
    assert [r["problem_id"] for r in rows] == ["p0", "p1", "p2"] and [r["rank"] for r in rows] == [0, 1, 2]
    assert [r["overlong_rate"] for r in rows] == [0.0, 0.25, 1.0]
    assert rows[0]["mean_len_excl_overlong"] == 10.0
    assert rows[1]["mean_len_excl_overlong"] == pytest.approx((4 * 31 - 64) / 3)  # = 20, the three kept samples
    assert math.isnan(rows[2]["mean_len_excl_overlong"])  # all overlong: undefined
    with pytest.raises(ValueError, match="lacks columns"):
        difficulty_rows({"problem_id": ["a"]}, 64)


def test_report_writes_figure_4_from_an_evaluate_run(store, tmp_path, capsys):  # noqa: F811
    uri, exp, client = store
    ev = client.create_experiment("rep-eval", artifact_location=str(tmp_path / "eval_artifacts"))
    run = client.create_run(ev, run_name="eval-x").info.run_id  # what experiments/evaluate.py's recorder writes
    client.log_table(run, data=TABLE, artifact_file="eval/arith/step_2/per_problem.json")
    client.log_metric(run, "eval/arith/max_new_tokens", 64.0, step=2)
    client.set_terminated(run)
    out = tmp_path / "report"
    proc = _report(capsys, uri, out, "--experiment", exp, "--eval-run", run, "--no-log")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(open(out / "difficulty.csv")))
    assert [(r["benchmark"], r["problem_id"], r["overlong_rate"]) for r in rows] == [
        ("arith step 2", "p0", "0.0"), ("arith step 2", "p1", "0.25"), ("arith step 2", "p2", "1.0")]
    assert float(rows[1]["mean_len_excl_overlong"]) == pytest.approx(20.0)
    assert (out / "figures" / "difficulty.png").stat().st_size > 1000
    proc = _report(capsys, uri, tmp_path / "bad", "--experiment", exp, "--eval-run",
                   client.search_runs([client.get_experiment_by_name(exp).experiment_id])[0].info.run_id)
    assert proc.returncode == 2 and "has no eval/<benchmark>/per_problem.json" in proc.stderr
