"""Sweeps (sweeps/*.yaml): every sweep composes into the jobs it promises, and a small multirun
lands in an MLflow server as child runs of one parent run, with params, tags and metrics.

The composition tests expand each sweep with Hydra's own BasicSweeper code (fspo/sweeps.py) and
compose every job's config. The slow test starts `mlflow server` on a free localhost port, runs
`experiments/run.py -m` (2 methods x 1 seed x 2 steps) against it and checks the runs through the
REST API (`/api/2.0/mlflow/...`).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from itertools import product

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from conftest import REPO, SMALL, free_port
from fspo.sweeps import job_config, list_sweeps, sweep_jobs
from fspo.tracking.sweep_parent import effective_grid


@pytest.fixture(autouse=True)
def parent_env(monkeypatch):
    """Jobs read the parent run id from the environment (set by the Hydra callback at launch)."""
    monkeypatch.setenv("FSPO_MLFLOW_PARENT_RUN_ID", "0123abcd")


def _jobs(name, overrides=()):
    """[(job overrides, resolved job config)] of a sweep."""
    out = []
    for job in sweep_jobs(name, overrides):
        cfg = job_config(name, job)
        OmegaConf.resolve(cfg)
        out.append((job, cfg))
    return out


def _common(cfg, sweep):
    assert cfg.logger.experiment_name == sweep and cfg.sweep.name == sweep
    assert cfg.tags.sweep == sweep and cfg.tags["mlflow.parentRunId"] == "0123abcd"
    instantiate(cfg.clip)  # the clip settings are valid (e.g. FSPO's c_dual >= c_upper)


def test_sweep_list():
    assert {"fspo_c", "fspo_z", "methods", "rloo_wide"} <= set(list_sweeps())
    assert "_base" not in list_sweeps()


@pytest.mark.parametrize("model", [None, "qwen3_8b"])
def test_fspo_c(model):
    extra = [f"+model={model}"] if model else []
    jobs = _jobs("fspo_c", extra)
    assert [j for j, _ in jobs] == [[f"sweep.c={c}", *extra] for c in ("0.01", "0.02", "0.03", "0.05")]
    for (_, cfg), c in zip(jobs, (0.01, 0.02, 0.03, 0.05)):
        _common(cfg, "fspo_c")
        assert cfg.method == "fspo" and cfg.clip._target_.endswith("FSPOClip") and cfg.clip.band == "fixed"
        assert cfg.clip.c_upper == cfg.clip.c_lower == c and cfg.clip.c_dual >= cfg.clip.c_upper
        assert float(cfg.tags.c) == c and cfg.model.name == (model or "tiny")


def test_fspo_z():
    jobs = _jobs("fspo_z")
    assert [j for j, _ in jobs] == [["sweep.z=1.0"], ["sweep.z=1.5"], ["sweep.z=2.0"]]
    for (_, cfg), z in zip(jobs, (1.0, 1.5, 2.0)):
        _common(cfg, "fspo_z")
        assert cfg.clip.band == "ema" and cfg.clip.z == z and float(cfg.tags.z) == z and cfg.method == "fspo"


@pytest.mark.parametrize("model", [None, "qwen3_1_7b"])
@pytest.mark.slow  # > 2.5 s: out of the quick loop (-m "not slow"), still in CI
def test_methods(model):
    extra = [f"+model={model}"] if model else []
    jobs = _jobs("methods", extra)
    methods, seeds = ("fspo", "grpo", "rloo", "gspo", "vespo"), (1, 2, 3)
    assert [j for j, _ in jobs] == [[f"+method={m}", f"seed={s}", *extra] for m, s in product(methods, seeds)]
    targets = {"fspo": "FSPOClip", "grpo": "GRPOClip", "rloo": "RLOOClip", "gspo": "GSPOClip",
               "vespo": "VESPOClip"}
    for (_, cfg), (m, s) in zip(jobs, product(methods, seeds)):
        _common(cfg, "methods")
        assert cfg.method == m and cfg.seed == s and cfg.clip._target_.endswith(targets[m])
        assert cfg.run_name == f"{m}_s{s}" and cfg.model.name == (model or "tiny")


def test_methods_command_line_replaces_grid():
    assert sweep_jobs("methods", ["+method=fspo,gspo", "seed=7", "steps=3"]) == [
        ["+method=fspo", "seed=7", "steps=3"], ["+method=gspo", "seed=7", "steps=3"]]


def test_rloo_wide():
    jobs = _jobs("rloo_wide")
    assert [j for j, _ in jobs] == [["seed=1"], ["seed=2"], ["seed=3"]]
    for _, cfg in jobs:
        _common(cfg, "rloo_wide")
        assert cfg.method == "rloo_wide" and cfg.clip._target_.endswith("RLOOClip")
        assert cfg.clip.clip_ratio_high == 20.0 and cfg.clip.clip_ratio_low == 0.95
        assert cfg.advantage._target_.endswith("grpo") and cfg.loss_agg_mode == "token-mean"


@pytest.mark.parametrize("name", ["fspo_c", "fspo_z", "methods", "rloo_wide"])
def test_parent_callback_registered(name):
    from fspo.sweeps import _compose

    cfg = _compose(name, [], return_hydra_config=True)
    assert cfg.hydra.callbacks.mlflow_parent._target_ == "fspo.tracking.sweep_parent.MLflowSweepParent"
    assert cfg.hydra.sweeper.params


def test_effective_grid():
    grid = effective_grid({"+method": "fspo,grpo", "seed": "1,2,3"}, ["+method=rloo", "seed=4,5", "steps=2", "lr=range(1,3)"])
    assert grid == {"+method": "rloo", "seed": "4,5", "lr": "range(1,3)"}


# ------------------------------------------------------------------ multirun against an MLflow server
def _api(base, path, body=None):
    """GET (body None) or POST JSON to the MLflow REST API."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


@pytest.fixture
def mlflow_server(tmp_path):
    """`mlflow server` on a free localhost port (SQLite store in tmp_path); stopped at the end."""
    port = free_port()
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{tmp_path}/m.db",
                             "--artifacts-destination", str(tmp_path / "artifacts"), "--host", "127.0.0.1",
                             "--port", str(port), "--workers", "1"],
                            cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while True:
            try:
                urllib.request.urlopen(base + "/health", timeout=5).read()
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"mlflow server did not start: {(tmp_path / 'server.log').read_text()[-2000:]}") from None
                time.sleep(1)
        yield base
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server's own process group (uvicorn workers included)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


@pytest.mark.slow
def test_multirun_logs_child_runs_to_server(mlflow_server, tmp_path):
    cmd = [sys.executable, "experiments/run.py", "-m", "--config-dir", "sweeps", "--config-name", "methods",
           "+method=fspo,grpo", "seed=1", *SMALL, "val.every_n_steps=1",
           f"logger.tracking_uri={mlflow_server}", f"hydra.sweep.dir={tmp_path / 'multirun'}"]
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "FSPO_MLFLOW_PARENT_RUN_ID")}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]

    exp = _api(mlflow_server, "/api/2.0/mlflow/experiments/get-by-name?experiment_name=methods")["experiment"]
    runs = _api(mlflow_server, "/api/2.0/mlflow/runs/search",
                {"experiment_ids": [exp["experiment_id"]], "max_results": 100})["runs"]
    flat = []
    for r in runs:
        d = r["data"]
        flat.append({"info": r["info"], "tags": {t["key"]: t["value"] for t in d.get("tags", [])},
                     "params": {p["key"]: p["value"] for p in d.get("params", [])},
                     "metrics": {m["key"]: m["value"] for m in d.get("metrics", [])}})
    parents = [r for r in flat if r["tags"].get("fspo.role") == "sweep_parent"]
    assert len(parents) == 1 and parents[0]["info"]["status"] == "FINISHED"
    parent = parents[0]
    assert parent["tags"]["sweep"] == "methods" and parent["metrics"]["sweep/jobs_ok"] == 2
    block = proc.stdout[proc.stdout.rindex("sweep methods finished"):]  # the sweep ends on where its results are
    assert "2 jobs finished, 0 failed" in block and f"id {parent['info']['run_id']}" in block
    assert f"methods (id {exp['experiment_id']})" in block and str(tmp_path / "multirun") in block
    assert f"{mlflow_server}/#/experiments/{exp['experiment_id']}" in block
    children = sorted((r for r in flat if r is not parent), key=lambda r: r["tags"]["method"])
    assert [c["tags"]["method"] for c in children] == ["fspo", "grpo"]
    for c, m in zip(children, ("fspo", "grpo")):
        assert c["info"]["status"] == "FINISHED" and c["info"]["run_name"] == f"{m}_s1"
        assert c["tags"]["mlflow.parentRunId"] == parent["info"]["run_id"]
        assert {k: c["tags"][k] for k in ("method", "seed", "model", "sweep")} == \
            {"method": m, "seed": "1", "model": "tiny", "sweep": "methods"}
        p = c["params"]
        assert p["method"] == m and p["seed"] == "1" and p["steps"] == "2" and p["sweep/name"] == "methods"
        assert p["clip/target"].endswith({"fspo": "FSPOClip", "grpo": "GRPOClip"}[m])
        for k in ("reward/mean", "val/accuracy", "rollout/response_len_mean", "clip/seq_frac",
                  "run/fairness.lre", "run/logratio.sigma_hat"):
            assert k in c["metrics"], (m, k)
        hist = _api(mlflow_server, f"/api/2.0/mlflow/metrics/get-history?run_id={c['info']['run_id']}&metric_key=reward/mean")
        assert sorted(int(x["step"]) for x in hist["metrics"]) == [0, 1]
        arts = _api(mlflow_server, f"/api/2.0/mlflow/artifacts/list?run_id={c['info']['run_id']}&path=plots")
        assert "plots/logratio_qq.png" in {f["path"] for f in arts.get("files", [])}
