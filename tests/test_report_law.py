"""The length law's targets table (fspo/evaluation/report/law.py) on hand-built run records."""
import pytest

from fspo.evaluation.report.collect import RunRecord
from fspo.evaluation.report.law import law_markdown, law_rows, run_shape


def _run(oob, counts, **scalars):
    m = {f"run/band/out_frac/len_{lo:05d}_{lo + 64:05d}": c for lo, c in oob.items()}
    m.update({f"run/band/n_seq/len_{lo:05d}_{lo + 64:05d}": n for lo, n in counts.items()})
    m.update({f"run/{k}": v for k, v in scalars.items()})
    return RunRecord("id", "r", "0", "FINISHED", metrics=m)


def test_shape_uses_bins_with_enough_sequences():
    """Bins [0,64) (5 sequences: dropped), [64,128), [256,320), [512,576): span 576 / 64 = 9;
    c(L) 0.1 -> 0.3 -> 0.4: first 0.1, last 0.4, max/min 4."""
    r = _run({0: 0.9, 64: 0.1, 256: 0.3, 512: 0.4}, {0: 5, 64: 30, 256: 40, 512: 25})
    s = run_shape(r, min_count=20)
    assert (s["bins_lo"], s["bins_hi"], s["span"]) == (64, 576, 9.0)
    assert s["oob_first"] == 0.1 and s["oob_last"] == 0.4 and s["oob_max_min"] == pytest.approx(4.0)
    assert run_shape(r, min_count=1000)["span"] is None


def test_rows_average_runs_and_render():
    a = _run({64: 0.2, 512: 0.2}, {64: 50, 512: 50}, **{"logratio/std_exponent": 0.5, "fairness/lre": 0.01})
    b = _run({64: 0.2, 512: 0.3}, {64: 50, 512: 50}, **{"logratio/std_exponent": 0.6, "fairness/lre": 0.03})
    (row,) = law_rows({"fspo": [a, b]}, min_count=20)
    assert row["n_runs"] == 2 and row["std_exponent"] == pytest.approx(0.55) and row["lre"] == pytest.approx(0.02)
    assert row["oob_max_min"] == pytest.approx((1.0 + 1.5) / 2) and row["qq_r2"] is None
    md = law_markdown([row])
    assert md.splitlines()[2].startswith("| fspo | 2 | 0.550 |") and "| - |" in md
