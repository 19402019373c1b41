"""Sweeps (sweeps/*.yaml): every sweep composes into the jobs it promises, its bands follow the rule its arms
state, and a small multirun lands in an MLflow server as child runs of one parent run, with params, tags and
metrics.

Owns:
- every sweep, expanded with Hydra's own BasicSweeper code (fspo/sweeps.py), with every job's config composed;
- the length-fairness sweep (sweeps/length_fairness.yaml): every arm composes on the long-chain task with its
  `method` and `bands` tags, and the regime-matched bands follow sweeps/arm/fspo_matched.yaml's rule: every
  method's band, as an interval of the sequence log-ratio S at the median length L_med = 72, equals FSPO's
  z = 1 band c sqrt(L_med) with c = sigma_hat = 0.030;
- the length-law sweep (sweeps/length_law.yaml) on its task (conf/data/mod_chain.yaml): the task's reference
  responses span >= 20x in length, evenly in log L, with a prompt of fixed length; every arm composes with its
  tags; mini-batches hold whole groups; the matched bands follow sweeps/arm/fspo_law.yaml's rule at the pilot's
  median length L_med = 114 (c = 0.0015); the knock-out arm keeps advantages on the shortest third only;
- end to end: `mlflow server` on a free localhost port, `experiments/run.py -m` (2 methods x 1 seed x 2 steps)
  against it, the runs checked through the REST API (`/api/2.0/mlflow/...`).
"""
from __future__ import annotations

import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from itertools import product
from pathlib import Path

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from conftest import REPO, SMALL, free_port, sweep_arms
from fspo.clipping.vespo import vespo_band
from fspo.data.mod_chain import chain_lines
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
    grid = effective_grid({"+method": "fspo,grpo", "seed": "1,2,3"},
                          ["+method=rloo", "seed=4,5", "steps=2", "lr=range(1,3)"])
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
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri",
                             f"sqlite:///{tmp_path}/m.db",
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
                    tail = (tmp_path / 'server.log').read_text()[-2000:]
                    raise RuntimeError(f"mlflow server did not start: {tail}") from None
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
        hist = _api(mlflow_server,
                    f"/api/2.0/mlflow/metrics/get-history?run_id={c['info']['run_id']}&metric_key=reward/mean")
        assert sorted(int(x["step"]) for x in hist["metrics"]) == [0, 1]
        arts = _api(mlflow_server, f"/api/2.0/mlflow/artifacts/list?run_id={c['info']['run_id']}&path=plots")
        assert "plots/logratio_qq.png" in {f["path"] for f in arts.get("files", [])}


FAIRNESS_L_MED, FAIRNESS_SIGMA = 72, 0.030
# 0.2546: the interval of S every matched band clips at L_med
FAIRNESS_BAND = FAIRNESS_SIGMA * math.sqrt(FAIRNESS_L_MED)


@pytest.fixture(scope="module")
def fairness_arms():
    return sweep_arms("length_fairness")


def test_length_fairness_arms_compose_with_tags(fairness_arms):
    assert {"fspo_matched", "fspo_per_bin", "fspo_power", "fspo_quantile", "rloo_matched", "gspo_matched",
            "grpo_matched",
            "fspo_paper", "rloo_paper", "gspo_paper", "grpo_paper"} <= set(fairness_arms)
    for name, cfg in fairness_arms.items():
        method, bands = name.rsplit("_", 1) if name.endswith(("_matched", "_paper")) else (name, "matched")
        assert cfg.tags.method == cfg.method == method and cfg.tags.bands == bands, name
        assert cfg.data.train.max_ops == cfg.data.val.max_ops == 18 and cfg.steps == 40 and cfg.val.size == 128
        assert cfg.logger.experiment_name == "length_fairness"
        instantiate(cfg.clip)  # valid clip settings


def _log_bounds(clip):
    """(upper, lower) of a ratio-space band as log-ratio offsets: log(1 + high), -log(1 - low)."""
    return math.log1p(clip.clip_ratio_high), -math.log1p(-clip.clip_ratio_low)


def test_length_fairness_matched_bands_equal_at_median_length(fairness_arms):
    fspo = fairness_arms["fspo_matched"].clip
    assert fspo.c_upper == fspo.c_lower == pytest.approx(FAIRNESS_SIGMA)
    assert fspo.c_upper * math.sqrt(FAIRNESS_L_MED) == pytest.approx(FAIRNESS_BAND)
    for up, lo in (_log_bounds(fairness_arms["rloo_matched"].clip),):  # on S
        assert up == pytest.approx(FAIRNESS_BAND, rel=2e-3) and lo == pytest.approx(FAIRNESS_BAND, rel=2e-3)
    up, lo = _log_bounds(fairness_arms["gspo_matched"].clip)  # on S / L
    assert up * FAIRNESS_L_MED == pytest.approx(FAIRNESS_BAND,
                                                rel=2e-3) and lo * FAIRNESS_L_MED == pytest.approx(FAIRNESS_BAND,
                                                                                                   rel=2e-3)
    up, lo = _log_bounds(fairness_arms["grpo_matched"].clip)  # per token
    assert up == pytest.approx(FAIRNESS_SIGMA, rel=2e-3) and lo == pytest.approx(FAIRNESS_SIGMA, rel=2e-3)


def test_length_fairness_calibrated_arms_target_z_one(fairness_arms):
    for name, band in (("fspo_power", "power"), ("fspo_per_bin", "per_bin"), ("fspo_quantile", "quantile")):
        clip = fairness_arms[name].clip
        assert clip.band == band and clip.z == 1.0 and clip.ratio_grad == "per_token"


def test_length_fairness_optional_newer_baseline_arms_follow_the_same_rule():
    """cispo / sapo / gmpo / luspo / vespo fairness_arms (not in the default grid: add them with ``+arm=...``)."""
    extra = "+arm=cispo_matched,sapo_matched,gmpo_matched,luspo_matched,vespo_matched"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FSPO_MLFLOW_PARENT_RUN_ID", "0123abcd")
        jobs = {j[0].split("=", 1)[1]: job_config("length_fairness", j) for j in sweep_jobs("length_fairness", [extra])}
    assert set(jobs) == {"cispo_matched", "sapo_matched", "gmpo_matched", "luspo_matched", "vespo_matched"}
    for name, cfg in jobs.items():
        assert cfg.tags.bands == "matched" and cfg.tags.method == cfg.method == name[: -len("_matched")]
        instantiate(cfg.clip)
    up, lo = _log_bounds(jobs["cispo_matched"].clip)  # per-token IS weight, as GRPO
    assert up == pytest.approx(FAIRNESS_SIGMA, rel=2e-3) and lo == pytest.approx(FAIRNESS_SIGMA, rel=2e-3)
    # log space
    assert jobs["gmpo_matched"].clip.clip_ratio_high == jobs["gmpo_matched"].clip.clip_ratio_low == FAIRNESS_SIGMA
    # gate weight 1/2 at |r-1| = xi
    assert jobs["sapo_matched"].clip.tau_pos == pytest.approx(1.7627 / FAIRNESS_SIGMA, rel=2e-3)
    lo_v, hi_v = vespo_band(jobs["vespo_matched"].clip.k_pos, jobs["vespo_matched"].clip.lambda_pos)  # on S
    assert hi_v == pytest.approx(FAIRNESS_BAND, rel=2e-3) and -lo_v == pytest.approx(FAIRNESS_BAND, rel=2e-3)
    assert instantiate(jobs["vespo_matched"].clip).theory_clip_fraction([FAIRNESS_L_MED],
                                                                        FAIRNESS_SIGMA)[0] == pytest.approx(
        2 * 0.15865525, rel=5e-3)  # 2 Phi(-1): FSPO's z = 1 at L_med
    up, lo = _log_bounds(jobs["luspo_matched"].clip)  # GSPO's band on S / L
    assert up * FAIRNESS_L_MED == pytest.approx(FAIRNESS_BAND,
                                                rel=2e-3) and lo * FAIRNESS_L_MED == pytest.approx(FAIRNESS_BAND,
                                                                                                   rel=2e-3)


LAW_L_MED, LAW_SIGMA = 114, 0.0015
LAW_BAND = LAW_SIGMA * math.sqrt(LAW_L_MED)  # 0.016016
LAW_ARMS = {"fspo_law", "rloo_law", "gspo_law", "vespo_law", "measure", "knock"}


@pytest.fixture(scope="module")
def law_arms():
    return sweep_arms("length_law")


def test_length_law_task_spans_20x_with_a_fixed_prompt(law_arms):
    cfg = law_arms["fspo_law"]
    task = instantiate(cfg.data.train, size=4000)
    lengths = [len("\n".join(chain_lines(s.meta["v0"], s.meta["n"]))) + 1 for s in (task[i] for i in range(len(task)))]
    lo, med, hi = min(lengths), statistics.median(lengths), max(lengths)
    assert (lo, hi) == (24, 600) and hi / lo >= 20
    assert abs(med - LAW_L_MED) / LAW_L_MED < 0.15, med  # the matched bands' L_med (the pilot's generated median)
    assert hi <= cfg.rollout.sampling.max_new_tokens
    assert {len(task[i].prompt) for i in range(len(task))} == {10} and cfg.data.max_prompt_len >= 10


def test_length_law_arms_compose_with_tags_and_whole_group_mini_batches(law_arms):
    assert set(law_arms) == LAW_ARMS
    for name, cfg in law_arms.items():
        assert cfg.tags.method == cfg.method and (cfg.tags.bands == "knock") == (name == "knock")
        assert cfg.ppo.mini_batch_unit == "prompts" and cfg.loss_agg_mode == "token-mean"
        assert cfg.logger.experiment_name == "length_law" and cfg.model.path == "fspo/assets/tiny_warmstart_chain"
        assert cfg.reward._target_ == "fspo.rewards.mod_chain.ChainConsistencyReward"
        instantiate(cfg.clip)
        assert (cfg.advantage_mask is not None) == (name == "knock")
    assert law_arms["knock"].advantage_mask.fraction == pytest.approx(0.333)
    assert law_arms["measure"].clip.c_upper >= 10  # never binds


def test_length_law_matched_bands_equal_at_median_length(law_arms):
    fspo = law_arms["fspo_law"].clip
    assert fspo.c_upper * math.sqrt(LAW_L_MED) == pytest.approx(LAW_BAND)
    up, lo = _log_bounds(law_arms["rloo_law"].clip)  # on S
    assert up == pytest.approx(LAW_BAND, rel=1e-4) and lo == pytest.approx(LAW_BAND, rel=1e-4)
    up, lo = _log_bounds(law_arms["gspo_law"].clip)  # on S / L
    assert up * LAW_L_MED == pytest.approx(LAW_BAND, rel=1e-4) and lo * LAW_L_MED == pytest.approx(LAW_BAND, rel=1e-4)


def test_length_law_chain_warm_start_fits_prompt_and_response(law_arms):
    cfg = law_arms["fspo_law"]
    asset = Path(__file__).resolve().parents[1] / cfg.model.path
    config = json.loads((asset / "config.json").read_text())
    assert config["max_position_embeddings"] >= cfg.data.max_prompt_len + cfg.rollout.sampling.max_new_tokens
    made = json.loads((asset / "warmstart.json").read_text())
    assert made["args"]["task"] == "mod_chain" and made["args"]["slip"] == 0.3
    by_len = made["history"][-1]["sampled_acc_by_length"]  # mean credit at T = 1, per length bin
    assert all(0.3 <= c <= 0.8 for c, n in by_len.values() if n >= 8), by_len


def test_length_law_planned_size_has_power(law_arms):
    """benchmarks/law_power.py at the planned measured sequences per arm: every target passes with probability
    >= 0.8 when the law holds exactly (a small simulation here; the script's default is 300 sweeps)."""
    from law_power import main

    cfg = law_arms["fspo_law"]
    measured = cfg.steps * cfg.prompts_per_step * cfg.rollout.sampling.n * 3 // 4
    p = main(["--seqs", str(measured), "--sims", "40", "--seed", "1"])
    assert p["all"] >= 0.8, p
