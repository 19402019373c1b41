"""Placement (fspo/runtime/launch/placement.py): a model meant for GPUs (``model.device: cuda``, the Qwen3
presets) trains on the GPUs the machine has, with float32 masters and bf16 compute, FSDP when several
processes are launched, vLLM when installed and HF generation in bf16 when not; an explicit setting on
the command line always wins; with no GPU the run stops at once with one line.

The machine is a `Machine` value here (CUDA visible or not, GPUs, processes, vLLM), so every case runs on
this CPU machine; ``torch.cuda.is_available`` / ``device_count`` are patched for `Machine.detect`.
Before placement, ``+model=qwen3_8b`` kept ``trainer.accelerator: cpu`` and ``rollout: hf`` on a GPU
machine (the GPU unused, silently) and, on a CPU machine, failed on a host-RAM memory plan.
"""
from __future__ import annotations

import logging

import pytest
import torch
from omegaconf import OmegaConf

from conftest import compose_config, register_entry_case
from fspo.runtime.launch.placement import Machine, PlacementError, named_keys, place

ONE_GPU = Machine(cuda=True, gpus=1, world=1, vllm=False)
CPU_ONLY = Machine(cuda=False, gpus=0, world=1, vllm=False)


def _placed(overrides, machine):
    cfg = compose_config(overrides)
    return cfg, place(cfg, overrides, machine)


@pytest.mark.parametrize("model", ["qwen3_8b", "qwen3_1_7b"])
def test_one_gpu_one_process_trains_on_cuda_with_fp32_masters_and_bf16_compute(model):
    cfg, choices = _placed(["+method=fspo", f"+model={model}"], ONE_GPU)
    assert cfg.trainer.accelerator == "gpu" and cfg.trainer.devices == 1
    assert cfg.model.dtype == "float32" and cfg.ppo.autocast == "bf16"  # masters float32, compute bf16
    assert cfg.ppo.old_log_probs == "recompute"  # the interpolation follows rollout.old_log_probs
    assert cfg.rollout.engine._target_ == "fspo.rollout.hf.HFEngine" and cfg.rollout.engine.autocast == "bf16"
    assert len(choices) == 4 and all("=" in c for c in choices)
    from hydra.utils import instantiate

    from fspo.update.settings import PPOConfig  # the placed settings are a valid PPO config
    assert isinstance(instantiate(cfg.ppo), PPOConfig)


def test_vllm_is_used_when_installed():
    cfg, choices = _placed(["+model=qwen3_8b"], Machine(cuda=True, gpus=1, world=1, vllm=True))
    assert cfg.rollout.name == "vllm" and cfg.rollout.engine._target_ == "fspo.rollout.vllm.VLLMEngine"
    assert cfg.rollout.engine.gpu_memory_utilization == 0.5 and cfg.ppo.old_log_probs == "recompute"
    assert "autocast" not in cfg.rollout.engine and any(c.startswith("rollout=vllm") for c in choices)


def test_several_processes_shard_with_fsdp():
    cfg, choices = _placed(["+model=qwen3_8b"], Machine(cuda=True, gpus=8, world=8, vllm=False))
    assert cfg.trainer.strategy._target_ == "fspo.runtime.launch.distributed.FSDP2Strategy"
    assert cfg.trainer.strategy.mixed_precision == "auto" and cfg.trainer.accelerator == "gpu"
    assert cfg.trainer.strategy.layer_class == "Qwen3DecoderLayer"  # the interpolation resolves in place
    assert cfg.ppo.autocast is None  # FSDP2's mixed precision computes in bf16, not autocast
    assert any(c.startswith("trainer=fsdp") for c in choices)


@pytest.mark.parametrize("explicit,check", [
    (["trainer=cpu"], lambda c: c.trainer.accelerator == "cpu" and c.ppo.autocast is None),
    (["trainer.accelerator=cpu"], lambda c: c.trainer.accelerator == "cpu"),
    (["ppo.autocast=null"], lambda c: c.ppo.autocast is None and c.trainer.accelerator == "gpu"),
    (["rollout=hf"], lambda c: "autocast" not in c.rollout.engine and c.rollout.name == "hf"),
    (["ppo.old_log_probs=engine", "ppo.autocast=null"], lambda c: c.ppo.old_log_probs == "engine"),
    (["trainer.devices=2"], lambda c: c.trainer.devices == 2),
])
def test_an_explicit_setting_always_wins(explicit, check):
    cfg, _ = _placed(["+model=qwen3_8b", *explicit], Machine(cuda=True, gpus=2, world=1, vllm=True))
    assert check(cfg)


def test_no_gpu_is_one_line_saying_what_it_needs():
    cfg = compose_config(["+model=qwen3_8b"])
    with pytest.raises(PlacementError) as e:
        place(cfg, ["+model=qwen3_8b"], CPU_ONLY)
    msg = str(e.value)
    assert "\n" not in msg and "CUDA" in msg and "model.path" in msg and "trainer.accelerator=cpu" in msg
    cfg, choices = _placed(["+model=qwen3_8b", "trainer.accelerator=cpu"], CPU_ONLY)  # asked for the CPU
    assert choices == [] and cfg.trainer.accelerator == "cpu"


def test_dry_run_plans_for_the_gpu_without_one():
    """The dry run is placed as the GPU run would be (one process, one GPU), so it plans that run."""
    cfg, choices = _placed(["+model=qwen3_8b", "dry_run=true", "memory_plan.device_gib=80"], CPU_ONLY)
    gpu, _ = _placed(["+model=qwen3_8b", "dry_run=true", "memory_plan.device_gib=80"], ONE_GPU)
    assert cfg == gpu and cfg.trainer.accelerator == "gpu" and cfg.ppo.autocast == "bf16" and len(choices) == 4


def test_a_cpu_model_stays_but_a_visible_gpu_is_never_silently_unused(caplog):
    with caplog.at_level(logging.WARNING, logger="fspo.runtime.launch.placement"):
        cfg, choices = _placed([], ONE_GPU)
    assert choices == [] and cfg.trainer.accelerator == "cpu"
    assert "CUDA GPU is visible but this run trains on the CPU" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fspo.runtime.launch.placement"):
        _placed([], CPU_ONLY)
    assert caplog.text == ""


def test_detect_reads_cuda_and_the_launcher(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    m = Machine.detect({"WORLD_SIZE": "4"})
    assert (m.cuda, m.gpus, m.world) == (True, 4, 4)
    cfg = compose_config(["+model=qwen3_1_7b"])
    place(cfg, ["+model=qwen3_1_7b"])  # Machine.detect with the patched torch: CUDA is used
    assert cfg.trainer.accelerator == "gpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert Machine.detect({"SLURM_NTASKS": "2"}) == Machine(cuda=False, gpus=0, world=2, vllm=m.vllm)


def test_named_keys():
    assert named_keys(["trainer=fsdp", "+ppo.autocast=bf16", "~rollout.engine.x"]) == {
        "trainer", "group:trainer", "ppo", "ppo.autocast", "rollout", "rollout.engine", "rollout.engine.x"}


def test_bad_model_device_is_one_line():
    with pytest.raises(PlacementError, match="model.device=gpu: must be cpu"):
        place(compose_config(["model.device=gpu"]), [], CPU_ONLY)


register_entry_case("placement/flagship", ["+method=fspo", "+model=qwen3_8b", "hydra.run.dir={dir}/h"],
                    {"MLFLOW_TRACKING_URI": "sqlite:///{dir}/m.db"})


@pytest.mark.slow  # a full import of the stack
def test_the_flagship_command_without_a_gpu_exits_in_one_line(entry_case):
    """Measured alone on the 2-core machine: 10.6 s in all (`/usr/bin/time`); here the seconds after the
    imports are bounded, as in tests/test_bad_input.py (a loaded machine took 43 s for the imports alone). The
    command runs in conftest's `entry_case` interpreter."""
    from test_bad_input import single_error_line

    proc, elapsed, _ = entry_case("placement/flagship")
    line = single_error_line(proc)
    assert "trains on CUDA GPUs and none is visible" in line, line
    assert elapsed <= 20, f"took {elapsed:.1f} s after the imports"


def test_hf_engine_decodes_under_bf16_autocast():
    """The engine's log-probs of its samples against the float32 policy's: float32 decoding equals it to
    ~1e-6; under bf16 autocast the matmuls round (measured on CPU: mean gap 1.2e-3), so it is really on."""
    from fspo.models.tiny import build_tiny_model, build_tokenizer
    from fspo.rollout.base import SamplingConfig
    from fspo.rollout.hf import HFEngine
    from fspo.update.logprobs import response_log_probs

    policy = build_tiny_model(seed=0)
    gaps = {}
    for autocast in (None, "bf16"):
        engine = HFEngine(autocast=autocast)
        engine.setup(policy, build_tokenizer(), "")
        b = engine.generate([[5, 6, 7, 8]], SamplingConfig(n=4, max_new_tokens=16, seed=0))
        with torch.no_grad():
            ref, _ = response_log_probs(policy, b)
        gaps[autocast] = float((b.engine_log_probs - ref)[b.response_mask.bool()].abs().mean())
    assert gaps[None] < 1e-5 < 1e-4 < gaps["bf16"] < 0.05
    with pytest.raises(ValueError, match="rollout.engine.autocast"):
        HFEngine(autocast="fp8")
    assert OmegaConf.select(compose_config([]), "rollout.engine.autocast") is None


def test_gpus_left_idle_by_the_launch_are_named(caplog):
    with caplog.at_level(logging.WARNING, logger="fspo.runtime.launch.placement"):
        _placed(["+model=qwen3_8b"], Machine(cuda=True, gpus=8, world=1, vllm=False))
    assert "8 CUDA GPUs are visible and 1 process(es) were launched, one GPU each: 7 stay unused" in caplog.text
    assert "torchrun --nproc_per_node=8" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fspo.runtime.launch.placement"):
        _placed(["+model=qwen3_8b"], Machine(cuda=True, gpus=8, world=8, vllm=False))
    assert caplog.text == ""
