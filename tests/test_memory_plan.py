"""The start-up memory plan (fspo/runtime/launch/memory_plan.py): its formulas on hand-computed numbers, the
parameter count against the real model, and the refusal of a layout that cannot fit (the error names
the numbers and the fix). No mocks: ``available`` is an explicit argument of `check_memory_plan`."""
from __future__ import annotations

from dataclasses import replace

import pytest

from conftest import compose_config
from fspo.runtime.launch.memory_components import Layout
from fspo.runtime.launch.memory_plan import MemoryPlanError, ModelShape, check_memory_plan, model_shape, plan_memory

# V 10, H 4, 3 layers, 2 heads x d 2 (q 4), 1 kv head (kv 2), I 8, untied
SMALL = ModelShape(vocab=10, hidden=4, layers=3, heads=2, kv_heads=1, head_dim=2, intermediate=8, tied=False)


def test_parameter_count_by_hand():
    # layer: H q 16 + 2 H kv 16 + q H 16 + 3 H I 96 + 2 H 8 + 2 d 4 = 156
    assert SMALL.layer_params == 156
    # 2 V H (untied) 80 + H 4 + 3 x 156 = 552
    assert SMALL.params == 552


def test_parameter_count_equals_the_real_tiny_model():
    from fspo.models.tiny import build_tiny_model

    shape = model_shape({"source": "random", "arch": {}})
    # tiny: layer 128*128 + 2*128*64 + 128*128 + 3*128*512 + 256 + 64 = 246080; 100*128 + 128 + 4 layers
    assert shape.layer_params == 246080 and shape.params == 997248
    assert shape.params == sum(p.numel() for p in build_tiny_model().parameters())
    big = model_shape({"source": "random", "arch": {"vocab_size": 32000, "hidden_size": 768, "num_hidden_layers": 12,
                                                     "num_attention_heads": 12, "num_key_value_heads": 4,
                                                     "head_dim": 64, "intermediate_size": 2048}})
    assert big.params == sum(p.numel() for p in build_tiny_model(vocab_size=32000, hidden_size=768,
                                                                 num_hidden_layers=12, num_attention_heads=12,
                                                                 num_key_value_heads=4, head_dim=64,
                                                                 intermediate_size=2048).parameters())


def test_plan_two_ranks_bf16_compute_by_hand():
    p = plan_memory(SMALL, Layout(ranks=2, dtype_bytes=4, compute_bytes=2, micro_tokens=3, kv_rows=5, kv_len=7,
                                  kv_bytes=2))
    # shards 552*4/2 = 1104, + gathered root and 2 layers (552 - 3*156 + 2*156) * 2 = 792
    assert p.weights == 1104 and p.compute_weights == 792
    assert p.grads == 1104 and p.optimizer == 2208 and p.update_snapshot == 1104
    # per layer 3 tokens * (2 B * (6H 24 + 4q 16 + 4kv 8 + 4I 32) + norms' scales 4 (2 + 2 heads + kv_heads) 28)
    # = 564; x 3 layers
    assert p.activations == 564 * 3
    assert p.logits == 3 * 10 * (20 + 2)  # float32 logits saved 4 + backward temporaries 16 + the bf16 output 2
    # 2 (K, V) * 3 layers * kv 2 * 2 B * 5 rows * 7 positions
    assert p.kv_cache == 840 and p.engine_weights == 0
    # FSDP's root (552 - 3 x 156 = 84 parameters): unsharded bf16 gradients 2 + the float32 reduce-scatter input 4
    assert p.root_grads == 84 * (2 + 4)
    resident, train, generate = 1104 + 1104 + 2208, 792 + 1104 + 1692 + 660 + 504, 840
    assert (p.phase_total("resident"), p.phase_total("train"), p.phase_total("generate")) == (resident, train, generate)
    assert p.peak == resident + max(train, generate) == 9168
    assert p.fragmentation == p.cuda_context == p.nccl_buffers == 0  # not on a GPU


def test_plan_one_rank_checkpointing_chunked_head_and_a_sleeping_vllm():
    x = Layout(ranks=1, dtype_bytes=4, compute_bytes=4, micro_tokens=3, activation_checkpointing=True,
               engine="vllm", engine_bytes=2, engine_reserved=3000, engine_sleeps=True)
    p = plan_memory(SMALL, x)
    assert (p.weights, p.compute_weights, p.grads, p.optimizer) == (2208, 0, 2208, 4416)  # nothing gathered
    # layer inputs 3*4*4 per layer x 3 = 144, one layer's full set 3 tokens * (4 B * (24 + 16 + 8 + 32) + 28) = 1044
    assert p.activations == 144 + 1044 and p.logits == 3 * 10 * 20
    # vLLM: its own bf16 weights 552*2, the rest of its reservation is KV cache; both only while generating
    assert p.engine_weights == 1104 and p.kv_cache == 3000 - 1104
    assert p.phases["engine_weights"] == p.phases["kv_cache"] == "generate"
    assert p.peak == (2208 + 2208 + 4416) + max(2208 + 1188 + 600, 3000) == 12828
    awake = plan_memory(SMALL, replace(x, engine_sleeps=False))  # no sleep mode: held throughout
    assert awake.peak == 2208 + 2208 + 4416 + 3000 + 2208 + 1188 + 600
    chunked = plan_memory(SMALL, replace(x, head_chunk_rows=2))
    assert chunked.logits == min(3, 2) * 10 * 4 * 2  # one chunk's float32 logits and its softmax/gradient
    autocast = plan_memory(SMALL, replace(x, compute_bytes=2, autocast=True, activation_checkpointing=False))
    assert autocast.compute_weights == 552 * 2  # autocast's bf16 copies of the float32 weights
    # per token and layer: float32 4 (6H 24 + 2q 8 + 2kv 4) = 144, bf16 2 (7H 28 + 2q 8 + 2kv 4 + 6I 48) = 176, norms 28
    assert autocast.activations == 3 * (144 + 176 + 28) * 3 and autocast.logits == 3 * 10 * 22
    assert plan_memory(SMALL, replace(x, update_snapshot=False)).update_snapshot == 0
    lora = plan_memory(SMALL, replace(x, trainable_params=10))  # an adapter: state for its parameters only
    assert (lora.grads, lora.optimizer, lora.weights) == (40, 80, 2208)


def test_check_logs_and_passes_the_default_run(caplog):
    cfg = compose_config([])
    with caplog.at_level("INFO", logger="fspo.runtime.launch.memory_plan"):
        plan = check_memory_plan(cfg, available=2 ** 40)
    assert plan.weights == 997248 * 4 and plan.optimizer == 2 * 997248 * 4  # tiny warm start, fp32, one rank
    # rows: max(16 prompts x 8, 128 val prompts x 2) = 256 (engine batch 256); K,V of 4 layers x kv 64 x 4 B
    kv_len = int(cfg.data.max_prompt_len) + 128
    assert plan.kv_cache == 2 * 4 * 64 * 4 * 256 * kv_len
    assert "memory plan per rank (1 rank(s)): weights" in caplog.text


def test_check_refuses_a_layout_that_cannot_fit():
    cfg = compose_config(["+model=qwen3_100m", "trainer=fsdp", "trainer.devices=2"])
    with pytest.raises(MemoryPlanError, match=r"exceeds 0.90 x 0.50 GiB available per rank .*would fit with neither "
                       r"FSDP up to 256 GPUs nor LoRA r 64"):
        check_memory_plan(cfg, available=2 ** 29)  # activations of 8192 tokens alone: no rank count helps
    # 8 GiB (7.2 usable): 2 ranks with checkpointing need 0.75 resident + 0.14 gathered + 0.19 snapshot + 0.40
    # activations (8192 x 2 B x 768 x 12 layer inputs + one layer 8192 x 2 x 16,896) + 5.37 logits
    # (8192 x 32000 x 22 B) = 6.85 GiB; without checkpointing 6.19 GiB of activations alone
    with pytest.raises(MemoryPlanError,
                       match=r"exceeds 0.90 x 8.00 GiB .*would fit with FSDP over 2 GPUs \(trainer=fsdp "
                       r"trainer.devices=2 trainer.strategy.activation_checkpointing=true\)"):
        check_memory_plan(cfg, available=2 ** 33)
    plan = check_memory_plan(cfg, available=2 ** 40)
    assert plan.ranks == 2 and plan.grads == model_shape(cfg.model).params * 4 // 2
    off = compose_config(["+model=qwen3_100m", "memory_plan.check=false"])
    assert check_memory_plan(off, available=2 ** 20).peak > 2 ** 20  # logged, not refused
    bad = compose_config(["memory_plan.headroom=1.5"])
    with pytest.raises(ValueError, match=r"memory_plan.headroom=1.5 must be in \(0, 1\]"):
        check_memory_plan(bad, available=2 ** 40)


def test_qwen3_8b_parameter_count_matches_the_model_card():
    """Qwen3-8B's config (V 151936, H 4096, 36 layers, 32 heads / 8 kv of 128, I 12288, untied): the
    card says 8.2B parameters, 6.95B without embeddings."""
    s = ModelShape(vocab=151936, hidden=4096, layers=36, heads=32, kv_heads=8, head_dim=128, intermediate=12288,
                   tied=False)
    # layer: 4096*4096 + 2*4096*1024 + 4096*4096 + 3*4096*12288 + 2*4096 + 2*128 = 192,946,432
    assert s.layer_params == 192_946_432
    assert s.params == 2 * 151936 * 4096 + 4096 + 36 * 192_946_432 == 8_190_735_360
    # 8 ranks, fp32 masters, bf16 compute: AdamW state 2 x 4 B x N / 8 = 7.63 GiB per rank
    p = plan_memory(s, Layout(ranks=8, dtype_bytes=4, compute_bytes=2, micro_tokens=1))
    assert p.optimizer == 2 * 4 * 8_190_735_360 // 8 == 8_190_735_360


def test_train_refuses_before_the_model_loads_or_mlflow_opens(tmp_path):
    from fspo.train import train

    cfg = compose_config(["memory_plan.headroom=1e-9"], output_dir=tmp_path / "out",
                         tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", artifact_location=tmp_path / "art")
    with pytest.raises(MemoryPlanError, match=r"exceeds 0.00 x .* GiB available per rank \(host RAM\)"):
        train(cfg)
    assert not (tmp_path / "mlflow.db").exists()  # refused before the tracking store was opened


# ------------------------------------------------------------------ per-rank device, dry run, what fits
QWEN3_8B = ModelShape(vocab=151936, hidden=4096, layers=36, heads=32, kv_heads=8, head_dim=128, intermediate=12288,
                      tied=False)


def test_local_device_index_from_the_launcher():
    from fspo.runtime.launch.memory_plan import local_device_index

    assert local_device_index({"LOCAL_RANK": "3"}, device_count=8) == 3      # torchrun / Lightning
    assert local_device_index({"SLURM_LOCALID": "5"}, device_count=8) == 5   # srun
    assert local_device_index({"LOCAL_RANK": "2", "SLURM_LOCALID": "6"}, device_count=8) == 2
    assert local_device_index({}, device_count=8) == 0
    assert local_device_index({"LOCAL_RANK": "3"}, device_count=1) == 0      # one visible GPU per process


def test_available_bytes_reads_this_ranks_gpu_not_gpu_0(monkeypatch):
    """CUDA cannot exist here: the two torch.cuda calls are replaced by a recording stand-in."""
    import torch

    from fspo.runtime.launch.memory_plan import available_bytes

    asked = []

    class Props:
        def __init__(self, i):
            asked.append(i)
            self.total_memory = (80 + i) * 2 ** 30

    monkeypatch.setattr(torch.cuda, "get_device_properties", Props)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert available_bytes(cuda=True, local_ranks=8) == 83 * 2 ** 30 and asked == [3]
    assert available_bytes(cuda=True, local_ranks=8, device_gib=141) == 141 * 2 ** 30  # memory_plan.device_gib
    assert asked == [3]


def test_model_configs_carry_the_architecture_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert model_shape(compose_config(["+model=qwen3_8b"]).model) == QWEN3_8B
    small = model_shape(compose_config(["+model=qwen3_1_7b"]).model)
    # Qwen3-1.7B card: 1.7B parameters, 1.4B without embeddings (tied)
    assert small.layers * small.layer_params == 28 * 50_336_000 == 1_409_408_000
    assert small.tied and small.params == 151936 * 2048 + 2048 + 1_409_408_000 == 1_720_574_976


def test_paper_8xh200_plan_by_hand():
    from fspo.runtime.launch.memory_plan import layout_of

    cfg = compose_config(["+experiment=paper_8xh200", "+method=fspo", "memory_plan.device_gib=141"])
    x = layout_of(cfg, QWEN3_8B, 141 * 2 ** 30)
    assert (x.ranks, x.dtype_bytes, x.compute_bytes, x.engine, x.engine_bytes, x.engine_sleeps) == \
        (8, 4, 2, "vllm", 2, True)
    p = plan_memory(QWEN3_8B, x)
    n = QWEN3_8B.params
    assert p.weights == p.grads == p.update_snapshot == 4 * n // 8 and p.optimizer == 8 * n // 8
    assert p.engine_weights == 2 * n and p.kv_cache == int(0.5 * 141 * 2 ** 30) - 2 * n
    # activation checkpointing at 20,480 tokens: layer inputs T 2 H x 36 + one layer (2 B (6H + 4q + 4kv + 4I = 94,208)
    # + the norms' scales 4 (2 + 2 x 32 heads + 8 kv heads) = 296)
    assert p.activations == 20480 * 2 * 4096 * 36 + 20480 * (2 * 94208 + 296)
    assert p.logits == 20480 * 151936 * 22
    # the update (a dense head over 20,480 tokens: 63.7 GiB of logits) now outweighs vLLM's share
    assert p.peak == p.phase_total("resident") + p.phase_total("train") < 0.9 * 141 * 2 ** 30


def test_what_would_fit_is_the_fewest_ranks():
    from fspo.runtime.launch.memory_plan import layout_of, what_would_fit

    cfg = compose_config(["+model=qwen3_8b", "memory_plan.device_gib=80"])
    x = layout_of(cfg, QWEN3_8B, 80 * 2 ** 30)
    budget = 0.9 * 80 * 2 ** 30
    assert plan_memory(QWEN3_8B, x).peak > budget
    assert what_would_fit(QWEN3_8B, x, budget) == \
        "FSDP over 8 GPUs (trainer=fsdp trainer.devices=8 trainer.strategy.activation_checkpointing=true)"
    at = lambda w, ac: plan_memory(QWEN3_8B,
                                   replace(x, ranks=w, compute_bytes=2, kv_bytes=2, activation_checkpointing=ac,
                                                     kv_rows=x.kv_rows // w)).peak  # noqa: E731
    # 2 ranks: resident (4 + 4 + 8) N / 2 and the snapshot alone exceed 72 GiB; 4 ranks with checkpointing do
    # too (77.3 GiB) with FSDP's unsharded root gradients and reduce-scatter buffer (1.25B x (2 + 4) B = 7.0 GiB)
    assert at(2, True) > budget and at(4, True) > budget and at(8, False) > budget and at(8, True) <= budget
    assert plan_memory(QWEN3_8B, replace(x, ranks=4)).root_grads == \
        (QWEN3_8B.params - 36 * QWEN3_8B.layer_params) * (x.compute_bytes + 4)
    assert what_would_fit(QWEN3_8B, x, 2 ** 30) is None  # 1 GiB: no FSDP layout up to 256 GPUs


DRY_RUNS = {  # experiments/run.py ... dry_run=true: each case once per session, all in one interpreter
    "8xh200": ["+experiment=paper_8xh200", "+method=fspo", "memory_plan.device_gib=141"],
    "8b_80gb": ["+method=fspo", "+model=qwen3_8b", "memory_plan.device_gib=80"],
    "8b_lora": ["+method=fspo", "+model=qwen3_8b", "model.lora.rank=64", "memory_plan.device_gib=80"],
    "8b_lora_f32": ["+method=fspo", "+model=qwen3_8b", "model.lora.rank=64", "model.dtype=float32",
                    "memory_plan.device_gib=80"],
    "8b_lora_no_fit": ["+method=fspo", "+model=qwen3_8b", "model.lora.rank=64", "memory_plan.auto_fit=false",
                       "memory_plan.device_gib=80"],
}


@pytest.fixture(scope="module")
def dry(tmp_path_factory):
    """``dry(case)`` -> (CompletedProcess, its folder): `experiments/run.py DRY_RUNS[case] dry_run=true` with the
    run folder and MLflow store in the case's folder, offline (conftest.run_py_cases)."""
    import os

    from conftest import run_py_cases

    def cases(folder):
        return {name: ([*args, "dry_run=true", f"output_dir={folder / name / 'out'}",
                        f"logger.tracking_uri=sqlite:///{folder / name / 'm.db'}"], {})
                for name, args in DRY_RUNS.items()}

    get = run_py_cases(tmp_path_factory, "memory_plan_dry_runs", cases, dict(os.environ, TRANSFORMERS_OFFLINE="1"))

    def one(case):
        proc, _, folder = get(case)
        return proc, folder

    return one


@pytest.mark.slow
def test_dry_run_paper_8xh200_fits_offline(dry):
    proc, folder = dry("8xh200")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "8 data-parallel rank(s); per rank 141.00 GiB (memory_plan.device_gib)" in out
    for part in ("weights", "compute_weights", "grads", "optimizer", "activations", "logits", "engine_weights",
                 "kv_cache", "peak"):
        assert f"\n  {part} " in out, part
    assert "trainable weights float32, compute bfloat16" in out and "fits: peak" in out
    assert not (folder / "m.db").exists()  # nothing opened or written


@pytest.mark.slow
def test_dry_run_8b_on_one_80gb_gpu_is_refused_naming_what_fits(dry):
    proc, _ = dry("8b_80gb")
    assert proc.returncode == 2
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: MemoryPlanError: ")
    assert "would fit with FSDP over 8 GPUs (trainer=fsdp trainer.devices=8" in err[0] and "LoRA" in err[0]
    assert "model.lora.rank=64 model.dtype=bfloat16" in err[0]  # LoRA with what auto-fit adds to it
    assert "\n  optimizer " in proc.stdout  # the plan was printed first


@pytest.mark.slow  # > 2.5 s: out of the quick loop (-m "not slow"), still in CI
def test_dry_run_8b_lora_on_one_80gb_gpu(dry):
    """Qwen3-8B with LoRA r 64 on one 80 GiB GPU, no other flag: auto-fit picks the bf16 frozen base, the
    chunked head and a smaller micro-batch, prints them, and the peak is <= 0.95 of the usable memory. Before
    auto-fit the same command was refused (a float32 base: 161 GiB); without auto-fit it still is."""
    import re

    proc, _ = dry("8b_lora")
    assert proc.returncode == 0, proc.stderr[-2000:]
    fit = re.search(r"^auto-fit: (.*): peak ([\d.]+) GiB = ([\d.]+) of 72.00 GiB usable per rank", proc.stdout, re.M)
    assert fit and "model.dtype=bfloat16" in fit[1] and "ppo.lm_head_chunk_rows=1024" in fit[1]
    assert float(fit[3]) <= 0.95 and f"fits: peak {fit[2]} GiB <= 72.00 GiB" in proc.stdout
    assert "LoRA r 64: frozen base bfloat16, adapters float32" in proc.stdout and "\n  adapters " in proc.stdout
    proc, _ = dry("8b_lora_f32")  # an explicit setting wins over auto-fit
    assert "model.dtype=bfloat16" not in proc.stdout.split("dry run:")[0]
    assert "frozen base float32" in proc.stdout
    proc, _ = dry("8b_lora_no_fit")
    assert proc.returncode == 2 and "would fit with" in proc.stderr and "model.dtype=bfloat16" in proc.stderr


def test_dry_run_and_device_gib_are_checked_up_front():
    from fspo.runtime.checks.config_check import ConfigError, check_config

    with pytest.raises(ConfigError, match=r"^memory_plan.device_gib=-1: must be a number > 0 or null .*; set "
                                          r"memory_plan.device_gib=80"):
        check_config(compose_config(["memory_plan.device_gib=-1"]))
    with pytest.raises(ConfigError, match=r"^dry_run=yes: must be one of True, False"):
        check_config(compose_config(["dry_run=yes"]))
    check_config(compose_config(["dry_run=true", "memory_plan.device_gib=141"]))


def test_dry_run_prints_every_component_in_process(capsys):
    from fspo.runtime.launch.memory_plan import dry_run

    lines = []
    plan = dry_run(compose_config(["+model=qwen3_1_7b", "memory_plan.device_gib=1000"]), out=lines.append)
    text = "\n".join(lines)
    assert text.startswith("dry run: qwen3_1_7b (1.721B parameters: 28 layers, hidden 2048, 16/8 heads")
    assert "1 data-parallel rank(s); per rank 1000.00 GiB (memory_plan.device_gib)" in text
    assert f"  {'peak':<16} {'':<9} {plan.peak / 2 ** 30:>9.2f}" in text and text.endswith("GiB usable per rank")
    for name, size in plan.parts.items():  # a line per component: name, phase, GiB
        assert f"  {name:<16} {plan.phases[name]:<9} {size / 2 ** 30:>9.2f}" in text
    with pytest.raises(MemoryPlanError, match="would fit with FSDP over"):
        dry_run(compose_config(["+model=qwen3_1_7b", "memory_plan.device_gib=80"]), out=lines.append)


def test_a_real_models_arch_builds_with_random_weights():
    """``+model=qwen3_1_7b model.source=random`` (a GPU smoke run without the hub): its ``arch:`` block names
    ``tie_word_embeddings``, which the random builder must pass once (twice is a TypeError before any work)."""
    from fspo.models.tiny import tiny_qwen3_config

    cfg = compose_config(["+model=qwen3_1_7b", "model.source=random"])
    assert model_shape(cfg.model).params == 1_720_574_976
    assert tiny_qwen3_config(hidden_size=64, num_attention_heads=2, head_dim=32,
                             tie_word_embeddings=False).tie_word_embeddings is False
