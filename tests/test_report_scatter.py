"""Figure 1 (left) of the report (fspo/evaluation/report/scatter.py): the per-bin mean +- 2 std band by hand,
the (L, S) sample a run logs (fspo/tracking/artifacts.py's `logratio_samples`, the diagnostics' reservoir), and
the report writing ``figures/sl_scatter.png`` and ``sl_band.csv`` from the runs' logged samples."""
from __future__ import annotations

import csv
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_report import _report, store  # noqa: F401  (the training runs' store fixture)

from fspo.diagnostics.bins import LengthBins
from fspo.diagnostics.log_ratio import LogRatioStats
from fspo.evaluation.report.scatter import band_rows
from fspo.tracking.artifacts import SAMPLES_FILE, logratio_samples


def test_band_rows_by_hand():
    L = np.array([4, 1, 2, 2, 3, 1, 3, 4], dtype=float)
    S = np.array([4.0, 0.0, -1.0, 1.0, 2.0, 2.0, 4.0, 8.0])
    rows = band_rows(np.stack([L, S], 1), n_bins=2)
    # lengths 1,1,2,2 -> S 0, 2, -1, 1 (stable order): mean 0.5, std sqrt((0.25 + 2.25 + 2.25 + 0.25) / 3)
    assert [(r["len_lo"], r["len_hi"], r["n"]) for r in rows] == [(1, 2, 4), (3, 4, 4)]
    assert rows[0]["mean"] == pytest.approx(0.5) and rows[0]["std"] == pytest.approx(np.sqrt(5 / 3))
    assert rows[1]["mean"] == pytest.approx(4.5) and rows[1]["mean_len"] == pytest.approx(3.5)  # S 2, 4, 4, 8
    # 3 bins: the first cut (8 / 3 -> 3) falls inside the length-2 pair, which stays in one bin
    assert [(r["len_lo"], r["len_hi"]) for r in band_rows(np.stack([L, S], 1), n_bins=3)] == [(1, 2), (3, 3), (4, 4)]


def test_run_logs_its_reservoir_sample():
    lr = LogRatioStats(LengthBins(width=4, max_len=16), reservoir_size=8)
    lr.update(torch.tensor([0.5, -0.25, 1.0]), torch.tensor([3, 5, 9]))
    got = logratio_samples(SimpleNamespace(log_ratio=lr))
    np.testing.assert_allclose(got, [[3, 0.5], [5, -0.25], [9, 1.0]])  # fewer than 8 seen: all of them, in order
    assert logratio_samples(SimpleNamespace(log_ratio=LogRatioStats(LengthBins(width=4), reservoir_size=0))) is None


def test_report_draws_the_scatter_from_logged_samples(store, tmp_path, capsys):  # noqa: F811
    uri, exp, client = store
    g = np.random.default_rng(0)
    for r in client.search_runs([client.get_experiment_by_name(exp).experiment_id], "tags.method = 'fspo'"):
        L = g.integers(10, 200, 300).astype(float)
        f = tmp_path / SAMPLES_FILE
        np.savetxt(f, np.stack([L, 0.03 * np.sqrt(L) * g.standard_normal(300)], 1), delimiter=",",
                   header="length,seq_log_ratio", comments="")
        client.log_artifact(r.info.run_id, str(f))
    out = tmp_path / "report"
    proc = _report(capsys, uri, out, "--experiment", exp, "--no-log")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "figures" / "sl_scatter.png").stat().st_size > 1000
    rows = list(csv.DictReader(open(out / "sl_band.csv")))
    assert {r["group"] for r in rows} == {"fspo"}  # the rloo runs logged no sample: no panel
    assert sum(int(r["n"]) for r in rows) == 600  # both fspo runs' samples, pooled
    std = [float(r["std"]) / np.sqrt(float(r["mean_len"])) for r in rows]
    assert np.mean(std) == pytest.approx(0.03, rel=0.2)  # the sqrt law the samples were drawn from
