"""Auto-fit (fspo/runtime/launch/auto_fit.py): a plan that does not fit picks, in order, the bf16 frozen LoRA
base, the chunked head, a smaller micro-batch budget and activation checkpointing, until the peak is at most
0.95 of the usable memory; prints what it chose; an explicit setting always wins; nothing changes when
nothing fits (the refusal then names what would). Before auto-fit, ``+model=qwen3_8b model.lora.rank=64`` on
80 GiB was refused (its float32 base) until the user found ``model.dtype=bfloat16 ppo.lm_head_chunk_rows=1024``.
"""
from __future__ import annotations

import pytest

from conftest import compose_config
from fspo.runtime.launch.auto_fit import MARGIN, auto_fit, fit_preview
from fspo.runtime.launch.memory_plan import MemoryPlanError, _plan, check_memory_plan
from fspo.runtime.launch.placement import Machine, place

GPU = Machine(cuda=True, gpus=1, world=1, vllm=False)
LORA_8B = ["+method=fspo", "+model=qwen3_8b", "model.lora.rank=64", "memory_plan.device_gib=80"]


def _fitted(overrides):
    cfg = compose_config(overrides)
    place(cfg, overrides, GPU)
    lines = []
    return cfg, auto_fit(cfg, overrides, out=lines.append), lines


def _peak_share(cfg):
    _, _, plan, avail, _, headroom = _plan(cfg, None)
    return plan.peak / (headroom * avail)


def test_lora_8b_on_one_80_gib_gpu_fits_with_no_other_flag():
    cfg, chosen, lines = _fitted(LORA_8B)
    assert chosen == ["model.dtype=bfloat16", "ppo.autocast=null", "ppo.lm_head_chunk_rows=1024",
                      "ppo.micro_batch_max_tokens=4096"]
    assert cfg.model.dtype == "bfloat16" and cfg.ppo.autocast is None and cfg.ppo.lm_head_chunk_rows == 1024
    assert _peak_share(cfg) <= MARGIN
    assert len(lines) == 1 and lines[0].startswith("auto-fit: model.dtype=bfloat16 ppo.autocast=null")
    assert check_memory_plan(cfg) is not None  # and the plan check passes


def test_an_explicit_setting_wins():
    cfg, chosen, _ = _fitted([*LORA_8B, "ppo.micro_batch_max_tokens=8192"])
    assert cfg.ppo.micro_batch_max_tokens == 8192 and _peak_share(cfg) <= MARGIN
    assert chosen == ["model.dtype=bfloat16", "ppo.autocast=null", "ppo.lm_head_chunk_rows=1024",
                      "model.activation_checkpointing=true"]  # the budget is the user's: the next step instead
    cfg, chosen, _ = _fitted([*LORA_8B, "model.dtype=float32"])  # a float32 base: the rest has to make room
    assert cfg.model.dtype == "float32" and not any(c.startswith("model.dtype") for c in chosen)
    # (float32 base + its bf16 autocast copies: 45.8 GiB before any activation)
    assert chosen == ["ppo.lm_head_chunk_rows=1024", "ppo.micro_batch_max_tokens=1024"]
    assert _peak_share(cfg) <= MARGIN


def test_a_plan_that_fits_is_left_alone():
    cfg, chosen, lines = _fitted(["+method=fspo", "+model=qwen3_1_7b", "memory_plan.device_gib=1000"])
    assert chosen == [] and lines == [] and cfg.ppo.lm_head_chunk_rows == 0


def test_nothing_fits_changes_nothing_and_the_refusal_names_what_would():
    over = ["+method=fspo", "+model=qwen3_8b", "memory_plan.device_gib=80"]
    cfg, chosen, _ = _fitted(over)
    assert chosen == [] and cfg.ppo.micro_batch_max_tokens == 8192 and not cfg.model.activation_checkpointing
    with pytest.raises(MemoryPlanError, match=r"FSDP over 8 GPUs .* or model.lora.rank=64 model.dtype=bfloat16"):
        check_memory_plan(cfg)
    assert fit_preview(cfg, {"model.lora.rank": 64})[0][0] == "model.dtype=bfloat16"


def test_auto_fit_off_and_plan_check_off():
    for off in ("memory_plan.auto_fit=false", "memory_plan.check=false"):
        cfg, chosen, _ = _fitted([*LORA_8B, off])
        assert chosen == [] and cfg.model.dtype == "float32"


def test_activation_checkpointing_under_fsdp_is_the_strategys():
    over = ["+experiment=paper_8xh200", "+method=fspo", "memory_plan.device_gib=80",
            "trainer.strategy.activation_checkpointing=false"]
    cfg, chosen, _ = _fitted(over)  # the user turned it off: kept off
    assert cfg.trainer.strategy.activation_checkpointing is False
    assert not any("activation_checkpointing" in c for c in chosen)
    cfg, chosen, _ = _fitted(["+experiment=paper_qwen3_1_7b", "+method=fspo", "memory_plan.device_gib=141"])
    assert chosen == ["ppo.lm_head_chunk_rows=1024", "model.activation_checkpointing=true"]
    assert _peak_share(cfg) <= MARGIN  # the budget is below the longest sequence already: not lowered


def test_the_micro_batch_budget_is_not_lowered_below_the_longest_sequence():
    from fspo.runtime.launch.auto_fit import _smaller_micro_batch

    cfg = compose_config(["+experiment=paper_qwen3_1_7b", "ppo.micro_batch_max_tokens=65536"])
    assert [c[0][1] for c in _smaller_micro_batch(cfg)] == [32768, 16384]  # 16,384 < 20,000: the longest rules
    assert list(_smaller_micro_batch(compose_config(["+experiment=paper_qwen3_1_7b"]))) == []
