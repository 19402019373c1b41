"""The report's by-length view (fspo/evaluation/report/by_length.py) with hand-computed numbers, the per-group
grid and the std(S_L) vs sqrt(L) figures, and the across-seeds table (fspo/evaluation/report/table.py)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from fspo.evaluation.report.by_length import by_length_markdown, by_length_rows, flatness, group_by_length, sampling_se
from fspo.evaluation.report.collect import RunRecord
from fspo.evaluation.report.figures import clip_by_length_grid, std_vs_sqrt_len_figure
from fspo.evaluation.report.table import fairness_rows, seeds_markdown, table1

A, B, C = "len_00016_00032", "len_00032_00048", "len_00224_inf"


def _run(seed, metrics, history=None):
    return RunRecord(f"r{seed}", f"r{seed}", "0", "FINISHED", {"method": "fspo", "seed": str(seed)},
                     metrics=metrics, history=history or {})


RUNS = [
    _run(1, {f"run/band/out_frac/{A}": 0.2, f"run/band/n_seq/{A}": 300.0, f"run/band/out_frac/{B}": 0.3,
             f"run/band/n_seq/{B}": 100.0, f"run/band/out_frac/{C}": 1.0, f"run/band/n_seq/{C}": 2.0,
             "val/accuracy": 0.2, "run/fairness/lre": 0.02, "run/band/out_frac": 0.25, "run/logratio/sigma_hat": 0.03,
             f"run/logratio/std/{A}": 0.15, f"run/logratio/std/{B}": 0.2},
         {"val/accuracy": [(0, 0.1), (20, 0.3), (40, 0.2)]}),
    # seed 2 saw no sequence in B (no key), 4 in C
    _run(2, {f"run/band/out_frac/{A}": 0.4, f"run/band/n_seq/{A}": 100.0, f"run/band/out_frac/{C}": 0.0,
             f"run/band/n_seq/{C}": 4.0, "val/accuracy": 0.4, "run/fairness/lre": 0.04, "run/band/out_frac": 0.35,
             "run/logratio/sigma_hat": 0.05, f"run/logratio/std/{A}": 0.25},
         {"val/accuracy": [(0, 0.1), (20, 0.5), (40, 0.4)]}),
]


def test_group_by_length_means_over_runs_and_counts_per_run():
    cells = group_by_length(RUNS)
    assert list(cells) == [A, B, C]
    # c: mean over the runs that saw the bin; n: sequences per run (a run without the bin counts 0)
    assert cells[A] == pytest.approx((0.3, 200.0))
    assert cells[B] == pytest.approx((0.3, 50.0))
    assert cells[C] == pytest.approx((0.5, 3.0))


def test_flatness_skips_thin_bins_and_reports_the_noise_floor():
    cells = group_by_length(RUNS)
    assert flatness(cells, 100) == (None, 1)  # only A has >= 100 sequences per run
    rng, n = flatness(cells, 50)  # A and B
    assert n == 2 and rng == pytest.approx(0.0)
    rng, n = flatness(cells, 1)  # all three: 0.5 - 0.3
    assert n == 3 and rng == pytest.approx(0.2)
    # se over 2 runs: A sqrt(0.3 * 0.7 / 400) = 0.02291, B sqrt(0.3 * 0.7 / 100) = 0.04583
    assert sampling_se(cells, 2, 50) == pytest.approx(math.sqrt(0.21 / 100))
    assert sampling_se(cells, 2, 100) == pytest.approx(math.sqrt(0.21 / 400))
    # runs logged before band/n_seq existed: every bin counts, no noise floor
    old = {A: (0.1, None), B: (0.4, None)}
    assert flatness(old, 100) == (pytest.approx(0.3), 2) and sampling_se(old, 1) is None


def test_by_length_markdown():
    rows = by_length_rows({"fspo": RUNS}, min_count=50)
    md = by_length_markdown(rows, min_count=50)
    assert ("| Method | n | 16-32 | 32-48 | 224-inf | max - min (bins with n >= 50; largest se) "
            "| pooled LRE (noise floor) |") in md
    assert "| fspo | 2 | 0.300<br>n=200 | 0.300<br>n=50 | (0.500<br>n=3) | 0.000 (2 bins; se 0.046) | " in md


def test_seeds_table_mean_and_sample_std():
    groups = {"fspo": RUNS}
    _, t1 = table1(groups)
    md = seeds_markdown(t1, fairness_rows(groups))
    # LRE (0.02, 0.04): mean 0.03, std 0.01414; out of band (0.25, 0.35): 0.300 +- 0.071;
    # best (0.3, 0.5): 0.400 +- 0.141; last (0.2, 0.4): 0.300 +- 0.141
    assert "| fspo | 2 | 1 2 | 0.0300 +- 0.0141 | 0.300 +- 0.071 | 0.400 +- 0.141 | 0.300 +- 0.141 |" in md


def test_grid_has_one_panel_per_group_with_thin_bins_hollow():
    fig = clip_by_length_grid({"a": RUNS, "b": RUNS[:1], "c": RUNS[1:]}, min_count=50)
    axes = [ax for ax in fig.axes if ax.axison]
    assert len(axes) == 3 and "LRE 0.030, max-min 0.00 (2 bins)" in axes[0].get_title()
    lines = {ln.get_label(): ln for ln in axes[0].get_lines()}
    assert list(lines["c(L) = 1 - q(L)"].get_xdata()) == [24.0, 40.0]
    assert list(lines["thin bin (n < 50)"].get_xdata()) == [224.0] and lines["thin bin (n < 50)"].get_mfc() == "none"


def test_std_vs_sqrt_len_figure():
    fig = std_vs_sqrt_len_figure({"fspo": RUNS})
    lines = {ln.get_label(): ln for ln in fig.axes[0].get_lines()}
    # A: mean std (0.15 + 0.25) / 2 = 0.2 at L 24; B: 0.2 at L 40 -> exponent 0
    (obs,) = [ln for name, ln in lines.items() if name.startswith("fspo")]
    assert list(obs.get_xdata()) == pytest.approx([np.sqrt(24), np.sqrt(40)])
    assert list(obs.get_ydata()) == pytest.approx([0.2, 0.2]) and "exponent 0.00" in obs.get_label()
    ref = lines["sigma sqrt(L), sigma = 0.040"]
    assert ref.get_ydata()[-1] == pytest.approx(0.04 * ref.get_xdata()[-1])


def test_pooled_lre_and_noise_floor_by_hand():
    from fspo.evaluation.report.by_length import pooled_lre

    # pooled counts: A n = 400, out = 300*0.2 + 100*0.4 = 100 -> q 0.75; B n = 100, out 30 -> q 0.7;
    # C n = 6, out 2 -> q 2/3; N = 506, q_bar = (300 + 70 + 4) / 506
    lre, floor = pooled_lre(RUNS)
    N, qb = 506.0, 374.0 / 506.0
    q = {400: 0.75, 100: 0.7, 6: 2 / 3}
    assert lre == pytest.approx(0.5 * sum(n * abs(v / qb - 1) for n, v in q.items()) / N)
    assert floor == pytest.approx(0.5 * sum(n * math.sqrt(2 / math.pi) * math.sqrt(qb * (1 - qb) / n) / qb
                                            for n in q) / N)
    # bins at or below the runs' lre_min_len are left out, as in the run-level LRE
    short = [_run(1, {**RUNS[0].metrics}), _run(2, {**RUNS[1].metrics})]
    for r in short:
        r.params["diagnostics/lre_min_len"] = "32"
    lre2, _ = pooled_lre(short)
    qb2 = 74.0 / 106.0
    assert lre2 == pytest.approx(0.5 * (100 * abs(0.7 / qb2 - 1) + 6 * abs((2 / 3) / qb2 - 1)) / 106)
    # runs without counts: no pooled LRE
    assert pooled_lre([_run(1, {f"run/band/out_frac/{A}": 0.2})]) == (None, None)
