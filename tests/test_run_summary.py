"""The block a training run, a sweep and an evaluation end on (fspo/tracking/run_summary.py): output and
checkpoint folders, tracking URI, experiment, run, key results, and the command or URL that opens them.

Owns: the block's content by hand for a SQLite store (a relative path made absolute in the `mlflow ui`
command), a file store and an http server (the run page URL instead), and one real tiny training run
(subprocess, CPU, conftest's SMALL settings) whose output ends with the block. The sweep's block is
checked in tests/test_sweeps.py (a real multirun against an MLflow server).
"""
from __future__ import annotations

import re

import pytest

from conftest import REPO
from fspo.tracking.run_summary import (
    RULE,
    absolute_uri,
    eval_summary,
    open_rows,
    sweep_summary,
    training_summary,
)


def test_open_rows_sqlite_file_http(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert open_rows("sqlite:///mlflow.db", "1", "abc")[0] == \
        ("open with", f"mlflow ui --backend-store-uri sqlite:///{tmp_path / 'mlflow.db'}")
    assert open_rows("sqlite:////data/m.db")[0] == ("open with", "mlflow ui --backend-store-uri sqlite:////data/m.db")
    assert open_rows("./mlruns")[0] == ("open with", f"mlflow ui --backend-store-uri file://{tmp_path / 'mlruns'}")
    assert open_rows("file:///data/mlruns", "0", "r")[0] == \
        ("open with", "mlflow ui --backend-store-uri file:///data/mlruns")
    assert open_rows("http://host:5000/", "7", "abc")[-1] == \
        ("run page", "http://host:5000/#/experiments/7/runs/abc/model-metrics?workflowType=machine_learning")
    assert open_rows("https://mlflow.example.org", "7")[-1] == \
        ("experiment page", "https://mlflow.example.org/#/experiments/7/runs?workflowType=machine_learning")
    assert open_rows("sqlite:////d/m.db", "3", "r") == [
        ("open with", "mlflow ui --backend-store-uri sqlite:////d/m.db"),
        ("experiment page", "http://127.0.0.1:5000/#/experiments/3/runs?workflowType=machine_learning"),
        ("run page", "http://127.0.0.1:5000/#/experiments/3/runs/r/model-metrics?workflowType=machine_learning")]
    assert open_rows("databricks", "7", "abc")[0] == ("tracking URI", "databricks")
    assert absolute_uri("http://host:5000") == "http://host:5000"


def test_training_block_sqlite(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    text = training_summary(tmp_path / "out", tmp_path / "out" / "checkpoints", "sqlite:///mlflow.db", "fspo", "3",
                            "brave-fox-1", "r123", {"val/accuracy": 0.5, "train/loss": 1.0}, start_accuracy=0.303,
                            steps=(0, 60), run_lre=0.02889)
    lines = text.splitlines()
    assert lines[0] == RULE and lines[-1] == RULE and lines[1] == "run brave-fox-1 finished"
    rows = {ln.split(":", 1)[0].strip(): ln.split(":", 1)[1].strip() for ln in lines[2:-1]}
    assert rows == {"output dir": str(tmp_path / "out"), "checkpoints": str(tmp_path / "out" / "checkpoints"),
                    "tracking URI": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment": "fspo (id 3)",
                    "run": "brave-fox-1 (id r123)", "results": "val/accuracy 0.5",
                    "held-out acc": "0.303 -> 0.500 (step 0 -> 60)", "run LRE": "0.0289",
                    "open with": f"mlflow ui --backend-store-uri sqlite:///{tmp_path / 'mlflow.db'}",
                    "experiment page": "http://127.0.0.1:5000/#/experiments/3/runs?workflowType=machine_learning",
                    "run page": "http://127.0.0.1:5000/#/experiments/3/runs/r123/model-metrics"
                                "?workflowType=machine_learning"}


def test_training_block_http(tmp_path):
    text = training_summary(tmp_path, tmp_path / "checkpoints", "http://127.0.0.1:5000", "fspo", "2", "x", "r9",
                            {"val/accuracy": 0.25})
    assert ("  run page:        http://127.0.0.1:5000/#/experiments/2/runs/r9/model-metrics"
            "?workflowType=machine_learning") in text.splitlines()
    assert "mlflow ui" not in text and "tracking URI:    http://127.0.0.1:5000" in text


def test_sweep_and_eval_blocks(tmp_path):
    text = sweep_summary("methods", str(tmp_path / "multirun"), "sqlite:////d/m.db", "methods", "4", "methods-2026",
                         "p1", jobs_ok=7, jobs_failed=1, status="FAILED")
    assert text.splitlines()[1] == "sweep methods failed: 7 jobs finished, 1 failed"
    for s in ("sweep dir:       " + str(tmp_path / "multirun"), "experiment:      methods (id 4)",
              "parent run:      methods-2026 (id p1)",
              "open with:       mlflow ui --backend-store-uri sqlite:////d/m.db",
              "experiment page: http://127.0.0.1:5000/#/experiments/4/runs?workflowType=machine_learning"):
        assert "  " + s in text.splitlines(), s
    assert text.count("7 jobs finished, 1 failed") == 1 and "finished, 1 failed" not in text.split("\n", 2)[2]
    md = tmp_path / "eval" / "summary.md"
    md.parent.mkdir()
    md.write_text("x")
    entries = [{"metrics": {"math500": {"avg_at_k": 0.125, "pass": 1.0}}}]
    text = eval_summary(tmp_path, "http://h:1", "fspo-eval", "5", "ev", "r2", entries, md)
    assert f"  summary:         {md}" in text and "results:         math500/avg_at_k 0.125" in text
    assert "run page:        http://h:1/#/experiments/5/runs/r2/model-metrics?workflowType=machine_learning" in text


@pytest.mark.slow
def test_training_run_ends_on_the_block(tiny_run):
    """A real tiny run (experiments/run.py, conftest's shared `tiny_run`: 3 steps, its store a relative
    sqlite:///store.db): its output ends with the block naming its folder and store."""
    tmp_path, out = tiny_run["dir"], tiny_run["out"]
    lines = tiny_run["stdout"].rstrip().splitlines()
    assert lines[-1] == RULE
    start = len(lines) - 1 - lines[::-1].index(RULE, 1)
    block = lines[start:]
    assert block[1].startswith("run ") and block[1].endswith(" finished")
    rows = {ln.split(":", 1)[0].strip(): ln.split(":", 1)[1].strip() for ln in block[2:-1]}
    run_id = (out / "mlflow_run_id").read_text().strip()
    assert rows["output dir"] == str(out) and rows["checkpoints"] == str(out / "checkpoints")
    assert rows["tracking URI"] == f"sqlite:///{tmp_path / 'store.db'}"
    assert rows["experiment"].startswith("fspo (id ") and rows["run"].endswith(f"(id {run_id})")
    assert "val/accuracy" in rows["results"]
    assert rows["open with"] == f"mlflow ui --backend-store-uri sqlite:///{tmp_path / 'store.db'}"
    assert re.fullmatch(r"\d\.\d{3} -> \d\.\d{3} \(step 0 -> 3\)", rows["held-out acc"]), rows
    assert float(rows["run LRE"]) >= 0
    assert rows["experiment page"].endswith("/runs?workflowType=machine_learning")
    assert rows["run page"].endswith(f"/runs/{run_id}/model-metrics?workflowType=machine_learning")
    assert any((out / "checkpoints").iterdir())


def test_sweep_report_command_groups_by_what_the_sweep_varies():
    """fspo_z's report must not merge the three z values into one row (`--group-by z`, not method)."""
    text = sweep_summary("fspo_z", None, "sqlite:////d/m.db", "fspo_z", "4", "p", "p1", jobs_ok=9, jobs_failed=0,
                         status="FINISHED", group_by="z")
    assert "  report:          python experiments/report.py --experiment fspo_z --group-by z --out reports/fspo_z" \
        in text.splitlines()
    from omegaconf import OmegaConf
    for path in sorted((REPO / "sweeps").glob("*.yaml")):
        if path.name.startswith("_"):
            continue
        cfg = OmegaConf.load(path)
        keys = str(cfg.sweep.group_by).split(",")
        swept = " ".join(str(v) for v in (cfg.hydra.sweeper.params or {}).keys())
        for k in keys:  # each key is a tag the sweep's runs carry (method is tagged on every run)
            assert k == "method" or k in (cfg.get("tags") or {}) or (k == "bands" and "arm" in swept), (path, k)
        assert ("sweep.c" in swept) == ("c" in keys) and ("sweep.z" in swept) == ("z" in keys), path
