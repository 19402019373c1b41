"""Figures and report lines that say what they compare, rounded, and why a number is missing.

Owns: the std-vs-sqrt(L) legend (the fitted exponent of std ~ L^b against L, 2 decimals, with theory L^0.5;
the theory line named as straight on that axis), the c(L) figure's caption when every measured point lies on
one side of the theory line, the report grid's title when too few bins are thick enough, and report.py's LRE
line (4 significant digits; "too few bins", not None). Leaves out: the figures' data (test_diag_plots.py,
test_report_by_length.py).
"""
from __future__ import annotations

import importlib.util

import numpy as np
from test_report_by_length import RUNS

from conftest import REPO
from fspo.diagnostics.plots import plot_clip_fraction_by_length, plot_std_vs_sqrt_len
from fspo.evaluation.report.figures import clip_by_length_grid


def test_the_std_legend_names_the_exponent_against_l_and_its_theory():
    L = np.array([16.0, 64.0, 256.0])
    fig = plot_std_vs_sqrt_len(L, 0.03 * L ** 1.0291, sigma=0.03)
    labels = [ln.get_label() for ln in fig.axes[0].get_lines()]
    assert labels[0] == "per-bin std: fit std ~ L^1.03 (theory L^0.5)", labels
    assert labels[1].startswith("theory sigma sqrt(L) (a straight line here)")


def test_the_c_of_l_caption_says_when_every_point_is_below_the_theory():
    obs = {"out of band": ([20.0, 60.0, 120.0], [0.01, 0.02, 0.015])}
    fig = plot_clip_fraction_by_length(obs, lambda L: np.full_like(L, 0.05), note="n = sequences per bin.")
    text = fig.texts[0].get_text()
    assert text.startswith("All 3 measured points lie below the theory line") and text.endswith("per bin.")
    mixed = plot_clip_fraction_by_length({"o": ([20.0, 60.0], [0.01, 0.09])}, lambda L: np.full_like(L, 0.05))
    assert not mixed.texts


def test_the_grid_title_says_when_too_few_bins_are_thick_enough():
    fig = clip_by_length_grid({"grpo": RUNS}, min_count=10_000)
    title = [ax for ax in fig.axes if ax.axison][0].get_title()
    assert "max-min: too few bins (0 with n >= 10000)" in title and "- (0 bins)" not in title


def test_the_report_lre_line_is_rounded_and_says_why_a_spread_is_missing():
    spec = importlib.util.spec_from_file_location("report_app", REPO / "experiments" / "report.py")
    app = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(app)
    assert app._round(0.0008843917322078239) == "0.0008844" and app._round(None) == "-"
    rows = [{"group": "grpo", "flatness": None, "n_populated": 0}, {"group": "fspo", "flatness": 0.123456}]
    assert app.flatness_text(rows, "grpo") == "- (too few bins: 0 of the 2 needed)"
    assert app.flatness_text(rows, "fspo") == "0.1235"
