"""benchmarks/bench_trl.py: the mapping of our config to TRL's GRPOConfig arguments (`trl_args`),
hand-checked, in any environment; with TRL installed (.venv-trl, benchmarks/setup_trl_env.sh) also
that GRPOConfig accepts the arguments and derives the same generation batch, and a tiny end-to-end
run of both sides at equal response lengths.
"""
from __future__ import annotations

import importlib.util
import json

import bench_trl  # benchmarks/bench_trl.py: benchmarks/ is on pytest's path (pyproject's pythonpath)
import pytest

from conftest import compose_config

HAS_TRL = importlib.util.find_spec("trl") is not None


def cfg_for(prompts=8, G=8, T=64, steps=6, mini_batch=32, extra=()):
    return compose_config(bench_trl.fspo_overrides(prompts, G, T, steps, mini_batch, 2e-5, "warmstart", "grpo")
                          + list(extra))


def test_default_setting_maps_to_two_updates_per_generation():
    kw = bench_trl.trl_args(cfg_for())  # 8 prompts x G 8 = 64 sequences, mini-batches of 32
    assert kw["per_device_train_batch_size"] == 32
    assert kw["gradient_accumulation_steps"] == 1
    assert kw["steps_per_generation"] == 2          # 64 / 32 optimizer steps per generation
    assert kw["num_generations"] == 8
    assert kw["num_iterations"] == 1
    assert kw["max_steps"] == 12                    # 6 RL steps x 2 updates
    assert kw["max_completion_length"] == 64
    assert kw["generation_kwargs"] == {"min_new_tokens": 64}
    assert kw["beta"] == 0.0 and kw["learning_rate"] == 2e-5 and kw["lr_scheduler_type"] == "constant"
    assert kw["temperature"] == 1.0 and kw["top_p"] == 1.0 and kw["top_k"] == 0
    assert kw["bf16"] is False and kw["gradient_checkpointing"] is False and kw["shuffle_dataset"] is False
    assert kw["max_grad_norm"] == 1.0 and kw["optim"] == "adamw_torch" and kw["loss_type"] == "bnpo"


def test_epochs_and_single_update():
    kw = bench_trl.trl_args(cfg_for(prompts=16, G=4, T=32, steps=3, mini_batch=16, extra=["ppo.epochs=2"]))
    assert (kw["steps_per_generation"], kw["num_iterations"], kw["max_steps"]) == (4, 2, 3 * 2 * 4)
    kw = bench_trl.trl_args(cfg_for(prompts=4, G=4, T=16, steps=2, mini_batch=16))
    assert (kw["per_device_train_batch_size"], kw["steps_per_generation"], kw["max_steps"]) == (16, 1, 2)


def test_natural_lengths_drop_min_new_tokens():
    cfg = compose_config(bench_trl.fspo_overrides(8, 8, 64, 6, 32, 2e-5, "warmstart", "grpo", natural=True))
    assert cfg.rollout.sampling.min_new_tokens == 0 and cfg.rollout.sampling.max_new_tokens == 64
    assert bench_trl.trl_args(cfg)["generation_kwargs"] is None


def test_no_min_new_tokens_means_no_generation_kwargs():
    kw = bench_trl.trl_args(cfg_for(extra=["rollout.sampling.min_new_tokens=0"]))
    assert kw["generation_kwargs"] is None and kw["max_completion_length"] == 64


@pytest.mark.parametrize("prompts,G,mini_batch", [(3, 4, 8), (8, 1, 8)])
def test_settings_trl_cannot_express_fail(prompts, G, mini_batch):
    with pytest.raises(ValueError):
        bench_trl.trl_args(cfg_for(prompts=prompts, G=G, mini_batch=mini_batch))


@pytest.mark.skipif(not HAS_TRL, reason="trl not installed (bash benchmarks/setup_trl_env.sh builds .venv-trl)")
def test_grpo_config_accepts_the_mapping(tmp_path):
    from trl import GRPOConfig

    args = GRPOConfig(output_dir=str(tmp_path), **bench_trl.trl_args(cfg_for()))
    assert args.generation_batch_size == 64 and args.steps_per_generation == 2
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == 32


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRL, reason="trl not installed (bash benchmarks/setup_trl_env.sh builds .venv-trl)")
def test_end_to_end_tiny(tmp_path):
    out = tmp_path / "bench.json"
    res = bench_trl.main(["--prompts", "2", "--G", "2", "--max-new-tokens", "8", "--steps", "1", "--mini-batch", "2",
                          "--model-source", "random", "--out", str(out),
                          "--tracking-uri", f"sqlite:///{tmp_path}/mlflow.db"])
    assert res["lengths_equal"]
    assert len(res["fspo"]["step_times_s"]) == len(res["trl"]["step_times_s"]) == 2
    assert res["trl"]["optimizer_steps"] == 2 * 2  # 2 RL steps x 2 updates
    assert json.loads(out.read_text())["ratio_trl_over_fspo"] > 0
