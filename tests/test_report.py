"""experiments/report.py: Table 1 (best = max over history, last = final step, mean over seeds)
against hand-computed numbers, the fairness summary, figures, and the ``report`` MLflow run.

Runs with known metric histories are logged here with the MLflow client into a SQLite store in
tmp_path (artifacts in tmp_path too), beside a sweep parent run and a FAILED run that the report
must leave out.
"""
from __future__ import annotations

import csv
import importlib.util
from types import SimpleNamespace

import numpy as np
import pytest
from matplotlib.figure import Figure
from scipy.special import ndtr

from conftest import REPO
from fspo.evaluation.report.collect import RunRecord
from fspo.evaluation.report.figures import theory_curve
from fspo.evaluation.report.table import group_runs, table1

FSPO = {"clip/target": "fspo.clipping.fspo.FSPOClip", "clip/c_upper": "0.03", "clip/c_lower": "0.03",
        "clip/c_dual": "0.03", "clip/band": "fixed", "clip/drift": "zero", "clip/z": "1.0",
        "clip/alpha": "0.1", "clip/sigma0": "0.03"}
RLOO = {"clip/target": "fspo.clipping.rloo.RLOOClip", "clip/clip_ratio_low": "0.4",
        "clip/clip_ratio_high": "0.667", "clip/clip_ratio_c": "3.0"}
# (method, seed): val/accuracy [(step, value)], eval/math500/avg_at_k, run/fairness/lre
RUNS = {
    ("fspo", 1): ([(0, 0.1), (1, 0.5), (2, 0.3)], [(0, 0.2), (2, 0.4)], 0.02),
    ("fspo", 2): ([(0, 0.2), (1, 0.3), (2, 0.4)], [(0, 0.6), (2, 0.1)], 0.04),
    ("rloo", 1): ([(0, 0.0), (1, 0.2)], [(1, 0.3)], 0.10),
    ("rloo", 2): ([(1, 0.1), (0, 0.6)], [(0, 0.5), (1, 0.7)], 0.20),  # logged out of step order
}
# hand-computed: mean over seeds of per-run best (max) / last (value at the final step)
EXPECTED = {
    "fspo": {"val/accuracy best": (0.5 + 0.4) / 2, "val/accuracy last": (0.3 + 0.4) / 2,
             "eval/math500/avg_at_k best": (0.4 + 0.6) / 2, "eval/math500/avg_at_k last": (0.4 + 0.1) / 2,
             "average best": (0.45 + 0.5) / 2, "average last": (0.35 + 0.25) / 2},
    "rloo": {"val/accuracy best": (0.2 + 0.6) / 2, "val/accuracy last": (0.2 + 0.1) / 2,
             "eval/math500/avg_at_k best": (0.3 + 0.7) / 2, "eval/math500/avg_at_k last": (0.3 + 0.7) / 2,
             "average best": (0.4 + 0.5) / 2, "average last": (0.15 + 0.5) / 2},
}


def _qq_figure() -> Figure:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = Figure(figsize=(2, 2))
    FigureCanvasAgg(fig)
    fig.add_subplot(1, 1, 1).plot([0, 1], [0, 1])
    return fig


@pytest.fixture
def store(tmp_path):
    """(tracking URI, experiment name) with the runs above, a sweep parent and a FAILED run."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'r.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment("rep", artifact_location=str(tmp_path / "artifacts"))
    parent = client.create_run(exp, run_name="rep-parent", tags={"fspo.role": "sweep_parent", "sweep": "rep"})
    client.log_metric(parent.info.run_id, "val/accuracy", 1.0)
    client.set_terminated(parent.info.run_id)
    for (method, seed), (val, m500, lre) in RUNS.items():
        run = client.create_run(exp, run_name=f"{method}_s{seed}", tags={
            "method": method, "seed": str(seed), "model": "tiny", "sweep": "rep",
            "mlflow.parentRunId": parent.info.run_id})
        rid = run.info.run_id
        for k, v in {**(FSPO if method == "fspo" else RLOO), "method": method, "seed": str(seed)}.items():
            client.log_param(rid, k, v)
        for step, v in val:
            client.log_metric(rid, "val/accuracy", v, step=step)
        for step, v in m500:
            client.log_metric(rid, "eval/math500/avg_at_k", v, step=step)
        for step in range(3):
            client.log_metric(rid, "reward/mean", 0.1 * step + seed * 0.01, step=step)
            client.log_metric(rid, "rollout/response_len_mean", 20.0 + step, step=step)
            client.log_metric(rid, "rollout/overlong_rate", 0.05 * step, step=step)
        for k, v in {"run/fairness/lre": lre, "run/fairness/lre_w": lre / 2, "run/logratio/sigma_hat": 0.03,
                     "run/fairness/binding_lre": 2 * lre, "run/band/out_frac": 0.3,
                     "run/clip/seq_frac/len_00000_00016": 0.1 * seed, "run/clip/seq_frac/len_00016_00032": 0.2,
                     "run/band/out_frac/len_00000_00016": 0.3, "run/band/out_frac/len_00016_00032": 0.35}.items():
            client.log_metric(rid, k, v, step=3)
        if seed == 1:
            client.log_figure(rid, _qq_figure(), "plots/logratio_qq.png")
        client.set_terminated(rid)
    failed = client.create_run(exp, run_name="failed", tags={"method": "fspo", "seed": "3"})
    client.log_metric(failed.info.run_id, "val/accuracy", 0.99)
    client.set_terminated(failed.info.run_id, status="FAILED")
    return uri, "rep", client


def _load_cli():
    spec = importlib.util.spec_from_file_location("report_cli", REPO / "experiments" / "report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


REPORT_CLI = _load_cli()


def _report(capsys, uri, out, *extra):
    """Run the command line in this process (saves the interpreter start-up); returns its rc/stdout/stderr."""
    rc = REPORT_CLI.main(["--tracking-uri", uri, "--out", str(out), *extra])
    cap = capsys.readouterr()
    return SimpleNamespace(returncode=rc, stdout=cap.out, stderr=cap.err)


def test_report_table_figures_and_mlflow_run(store, tmp_path, capsys):
    uri, exp, client = store
    out = tmp_path / "report"
    proc = _report(capsys, uri, out, "--experiment", exp)
    assert proc.returncode == 0, proc.stderr[-3000:]

    rows = {r["group"]: r for r in csv.DictReader(open(out / "table1.csv"))}
    assert list(rows) == ["base", "rloo", "fspo"]  # the paper's row order; parent and FAILED runs left out
    # base: mean over runs of the step-0 values (runs without a step-0 value are left out)
    assert float(rows["base"]["val/accuracy best"]) == pytest.approx((0.1 + 0.2 + 0.0 + 0.6) / 4)
    assert rows["base"]["eval/math500/avg_at_k last"] == "0.4333"  # (0.2 + 0.6 + 0.5) / 3, 4 significant digits
    assert float(rows["base"]["average best"]) == pytest.approx((0.225 + 1.3 / 3) / 2, rel=5e-4)
    for method, expected in EXPECTED.items():
        assert rows[method]["n_runs"] == "2" and rows[method]["seeds"] == "1 2"
        for k, v in expected.items():
            assert float(rows[method][k]) == pytest.approx(v, rel=5e-4), (method, k)  # CSV: 4 significant digits
    assert float(rows["fspo"]["val/accuracy best std"]) == pytest.approx(np.std([0.5, 0.4], ddof=1), rel=5e-4)
    md = (out / "table1.md").read_text()
    assert "| fspo | 2 | 0.4500/0.3500 | 0.5000/0.2500 | 0.4750/0.3000 |" in md

    fair = {r["group"]: r for r in csv.DictReader(open(out / "fairness.csv"))}
    assert float(fair["fspo"]["lre"]) == pytest.approx(0.03) and float(fair["rloo"]["lre"]) == pytest.approx(0.15)
    assert float(fair["rloo"]["lre_w"]) == pytest.approx(0.075)
    assert float(fair["rloo"]["binding_lre"]) == pytest.approx(0.30) and float(fair["fspo"]["out_of_band_frac"]) == 0.3
    assert "| fspo | 2 | 0.0300 +- 0.0141 | 0.0150 | 0.3000 | 0.0600 |" in (out / "report.md").read_text()
    assert float(fair["fspo"]["reward last"]) == pytest.approx((0.21 + 0.22) / 2)
    assert len(list(csv.DictReader(open(out / "runs.csv")))) == 4
    assert "\n4 runs. Best = " in (out / "report.md").read_text()  # the runs read, with no sequence records among them

    figs = {p.name for p in (out / "figures").glob("*.png") if p.stat().st_size > 1000}
    assert {"clip_fraction_by_length.png", "clip_fraction_by_length_fspo.png", "clip_fraction_by_length_rloo.png",
            "lre.png", "learning_curves.png", "overlong_rate.png", "logratio_qq_grid.png"} <= figs
    assert len(list((out / "qq").glob("*.png"))) == 2  # the two runs that logged a Q-Q plot
    assert "LRE fspo: 0.03" in proc.stdout

    assert not client.search_runs([client.get_experiment_by_name(exp).experiment_id], "tags.`fspo.role` = 'report'")
    reports = client.search_runs([client.get_experiment_by_name("fspo-reports").experiment_id],
                                 "tags.`fspo.role` = 'report'")  # its own experiment, not among the runs it reads
    assert len(reports) == 1 and reports[0].info.run_name == f"report-{exp}"
    rid = reports[0].info.run_id
    assert reports[0].data.metrics["lre/fspo"] == pytest.approx(0.03) and reports[0].data.params["n_runs"] == "4"
    assert reports[0].data.metrics["val/accuracy/best/rloo"] == pytest.approx(0.4)
    arts = {a.path for a in client.list_artifacts(rid)} | {a.path for a in client.list_artifacts(rid, "figures")}
    assert {"table1.csv", "table1.md", "report.md", "fairness.csv", "figures/lre.png"} <= arts

    # a second report reads the same 4 training runs (the report run itself is left out)
    proc = _report(capsys, uri, tmp_path / "again", "--experiment", exp, "--no-log", "--filter", "tags.method = 'fspo'")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["group"] for r in csv.DictReader(open(tmp_path / "again" / "table1.csv"))] == ["base", "fspo"]


def test_report_errors_are_one_line(store, tmp_path, capsys):
    uri, _, _ = store
    proc = _report(capsys, uri, tmp_path / "x", "--experiment", "nope")
    assert proc.returncode == 2 and "no MLflow experiment named ['nope']" in proc.stderr
    proc = _report(capsys, uri, tmp_path / "x", "--experiment", "rep", "--filter", "tags.method = 'gspo'")
    assert proc.returncode == 2 and "no FINISHED training runs" in proc.stderr


def _rec(method, seed, **kw):
    return RunRecord(f"{method}{seed}", f"{method}{seed}", "0", "FINISHED", {"method": method, "seed": str(seed)}, **kw)


def test_grouping_by_param_and_best_last():
    a = _rec("fspo", 1, params={"clip/c_upper": "0.01"}, metrics={"val/accuracy": 0.0},
             history={"val/accuracy": [(0, 0.2), (1, 0.6), (2, 0.1)]})
    b = _rec("fspo", 2, params={"clip/c_upper": "0.05"}, metrics={"val/accuracy": 0.0},
             history={"val/accuracy": [(0, 0.3)]})
    groups = group_runs([a, b], ["method", "clip/c_upper"])
    assert list(groups) == ["method=fspo,clip/c_upper=0.01", "method=fspo,clip/c_upper=0.05"]
    benches, rows = table1(groups)
    assert benches == ["val/accuracy"] and [r["group"] for r in rows][0] == "base"
    assert rows[0]["val/accuracy best"] == pytest.approx(0.25) and "average best" not in rows[1]
    assert (rows[1]["val/accuracy best"], rows[1]["val/accuracy last"]) == (0.6, 0.1)
    assert rows[2]["val/accuracy best std"] is None  # one run: no spread


def test_clip_by_length_falls_back_to_per_step_mean():
    r = _rec("rloo", 1, metrics={"clip/seq_frac/len_00000_00016": 0.4, "band/out_frac/len_00000_00016": 0.6},
             history={"clip/seq_frac/len_00000_00016": [(0, 0.2), (1, 0.4)],
                      "band/out_frac/len_00000_00016": [(1, 0.6), (2, 0.7)]})
    assert r.clip_by_length() == {"len_00000_00016": pytest.approx(0.3)}
    assert r.out_of_band_by_length() == {"len_00000_00016": pytest.approx(0.65)}
    r.metrics["run/clip/seq_frac/len_00000_00016"] = 0.25
    r.metrics["run/band/out_frac/len_00000_00016"] = 0.5
    assert r.clip_by_length() == {"len_00000_00016": 0.25}
    assert r.out_of_band_by_length() == {"len_00000_00016": 0.5}
    assert _rec("rloo", 2).out_of_band_by_length() == {}


def test_clip_by_length_figures_put_out_of_band_beside_theory():
    from fspo.evaluation.report.figures import clip_by_length_figures

    run = {"run/logratio/sigma_hat": 0.03, "run/band/out_frac/len_00000_00016": 0.3,
           "run/clip/seq_frac/len_00000_00016": 0.1}
    old = {"run/logratio/sigma_hat": 0.03, "run/clip/seq_frac/len_00000_00016": 0.1}  # before band/* existed
    groups = {"rloo": [_rec("rloo", 1, params=RLOO, metrics=run)], "fspo": [_rec("fspo", 1, params=FSPO, metrics=old)]}
    figs = clip_by_length_figures(groups)

    def labels(fig):
        return {ln.get_label(): ln for ln in fig.axes[0].get_lines()}

    rloo = labels(figs["clip_fraction_by_length_rloo"])
    assert {"rloo out of band", "rloo (binding clip)", "rloo theory (sigma=0.03)"} == set(rloo)
    assert list(rloo["rloo out of band"].get_ydata()) == [0.3]
    assert rloo["rloo (binding clip)"].get_linestyle() == ":"
    assert "fspo out of band" not in labels(figs["clip_fraction_by_length_fspo"])
    both = labels(figs["clip_fraction_by_length"])
    assert "rloo" in both and "fspo" not in both and list(both["rloo"].get_ydata()) == [0.3]


def test_theory_curves_from_params():
    L = np.array([1.0, 100.0])
    rloo = theory_curve(RLOO, 0.03)(L)
    s = 0.03 * np.sqrt(L)
    assert rloo == pytest.approx(ndtr(-np.log(1.667) / s) + ndtr(np.log(0.6) / s))
    assert theory_curve(FSPO, 0.03)(L) == pytest.approx([2 * ndtr(-1.0)] * 2)
    ema = {**FSPO, "clip/band": "ema", "clip/z": "1.5"}
    assert theory_curve(ema, 0.07)(L) == pytest.approx([2 * ndtr(-1.5)] * 2)
    assert theory_curve({"clip/target": "fspo.clipping.grpo.GRPOClip", "clip/clip_ratio_low": "0.2",
                         "clip/clip_ratio_high": "0.28", "clip/clip_ratio_c": "3.0"}, 0.03) is None
    assert theory_curve(RLOO, 0.0) is None
