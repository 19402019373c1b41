"""The start-up memory plan (fspo/runtime/memory_plan.py): its formulas on hand-computed numbers, the
parameter count against the real model, and the refusal of a layout that cannot fit (the error names
the numbers and the fix). No mocks: ``available`` is an explicit argument of `check_memory_plan`."""
from __future__ import annotations

import pytest

from conftest import compose_config
from fspo.runtime.memory_plan import MemoryPlanError, ModelShape, check_memory_plan, model_shape, plan_memory

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
    p = plan_memory(SMALL, dtype_bytes=4, compute_bytes=2, ranks=2, micro_tokens=3, kv_rows=5, kv_len=7)
    # shards 552*4/2 = 1104, + gathered root and 2 layers (552 - 3*156 + 2*156) * 2 = 792
    assert p.params == 1104 + 792
    assert p.grads == 1104 and p.optimizer == 2208
    # per layer 3 tokens * 2 B * (4H 16 + 2q 8 + 2kv 4 + 4I 32) = 360; x 3 layers + logits 3*10*4 = 120
    assert p.activations == 360 * 3 + 120
    # 2 (K, V) * 3 layers * kv 2 * 2 B * 5 rows * 7 positions
    assert p.kv_cache == 840
    assert p.total == 1896 + 1104 + 2208 + 1200 + 840 == 7248


def test_plan_one_rank_activation_checkpointing_and_engine_reservation():
    p = plan_memory(SMALL, 4, 4, 1, micro_tokens=3, kv_rows=5, kv_len=7, activation_checkpointing=True,
                    engine_reserved=1000)
    assert (p.params, p.grads, p.optimizer) == (2208, 2208, 4416)  # nothing gathered on one rank
    # layer inputs 3*4*4 per layer x 3 = 144, one layer's full set 3*4*60 = 720, logits 120
    assert p.activations == 144 + 720 + 120
    assert p.kv_cache == 1000  # vLLM's reservation replaces the KV estimate


def test_check_logs_and_passes_the_default_run(caplog):
    cfg = compose_config([])
    with caplog.at_level("INFO", logger="fspo.runtime.memory_plan"):
        plan = check_memory_plan(cfg, available=2 ** 40)
    assert plan.params == 997248 * 4 and plan.optimizer == 2 * 997248 * 4  # tiny warm start, fp32, one rank
    # rows: max(16 prompts x 8, 128 val prompts x 2) = 256 (engine batch 256); K,V of 4 layers x kv 64 x 4 B
    kv_len = int(cfg.data.max_prompt_len) + 128
    assert plan.kv_cache == 2 * 4 * 64 * 4 * 256 * kv_len
    assert "memory plan per rank (1 rank(s)): params" in caplog.text


def test_check_refuses_a_layout_that_cannot_fit():
    cfg = compose_config(["+model=qwen3_100m", "trainer=fsdp", "trainer.devices=2"])
    with pytest.raises(MemoryPlanError, match=r"exceeds 0.90 x 0.50 GiB available per rank .*activation_checkpointing"):
        check_memory_plan(cfg, available=2 ** 29)
    plan = check_memory_plan(cfg, available=2 ** 40)
    assert plan.ranks == 2 and plan.grads == model_shape(cfg.model).params * 4 // 2
    off = compose_config(["+model=qwen3_100m", "memory_plan.check=false"])
    assert check_memory_plan(off, available=2 ** 20).total > 2 ** 20  # logged, not refused
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
    p = plan_memory(s, 4, 2, 8, micro_tokens=1, kv_rows=0, kv_len=0)
    assert p.optimizer == 2 * 4 * 8_190_735_360 // 8 == 8_190_735_360


def test_train_refuses_before_the_model_loads_or_mlflow_opens(tmp_path):
    from fspo.train import train

    cfg = compose_config(["memory_plan.headroom=1e-9"], output_dir=tmp_path / "out",
                         tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", artifact_location=tmp_path / "art")
    with pytest.raises(MemoryPlanError, match=r"exceeds 0.00 x .* GiB available per rank \(host RAM\)"):
        train(cfg)
    assert not (tmp_path / "mlflow.db").exists()  # refused before the tracking store was opened
