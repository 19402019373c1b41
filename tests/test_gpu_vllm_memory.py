"""GPU lane: three vLLM sleep/wake/sync cycles keep the peak GPU memory flat.

A 0.18B-parameter Qwen3 (random weights, float32 master copy on the GPU with AdamW state) trains
beside a colocated `VLLMEngine` with sleep mode; each cycle is one `rollout_memory` hand-over
(fspo/rollout/engine_memory.py: gradients freed, empty_cache, weights woken, synced, KV cache woken,
generate, sleep) followed by a training step. The device's used memory (``mem_get_info``, which sees
vLLM's own allocator too) is sampled at every phase; the peak of cycles 2 and 3 may not exceed
cycle 1's by more than 256 MiB (a leaked bf16 weight copy would add ~0.37 GiB per cycle), and after each
sleep the engine's KV cache is given back. Skipped without CUDA or vLLM; CI never needs it.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="needs vllm (pip install 'fspo[vllm]')")]

GIB = 2**30
SLACK = 256 * 2**20


def _used() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def test_three_sleep_wake_sync_cycles_keep_peak_memory_flat(tmp_path):
    from fspo.models.tiny import build_tiny_model, build_tokenizer
    from fspo.rollout.base import SamplingConfig
    from fspo.rollout.engine_memory import rollout_memory
    from fspo.rollout.vllm import VLLMEngine

    tok = build_tokenizer()
    policy = build_tiny_model(seed=0, hidden_size=1024, intermediate_size=3072, num_hidden_layers=12,
                              num_attention_heads=16, num_key_value_heads=8, head_dim=64,
                              vocab_size=32768, max_position_embeddings=512).cuda()
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-5)
    engine = VLLMEngine(dtype="bfloat16", gpu_memory_utilization=0.3, enforce_eager=True, max_model_len=512)
    engine.setup(policy, tok, str(tmp_path))
    engine.sleep()
    prompts = [[5, 6, 7, 8]] * 8
    params = SamplingConfig(n=4, max_new_tokens=64, seed=0)
    peaks, asleep = [], []
    for _ in range(3):
        samples = [_used()]
        with rollout_memory(engine, policy, [opt]):
            samples.append(_used())
            batch = engine.generate(prompts, params)
            samples.append(_used())
        asleep.append(_used())
        ids = batch.input_ids().cuda()
        policy(input_ids=ids, labels=ids).loss.backward()  # gradients + AdamW state: the trainer's share
        opt.step()
        samples.append(_used())
        peaks.append(max(samples))
    engine.shutdown()
    assert peaks[1] <= peaks[0] + SLACK and peaks[2] <= peaks[0] + SLACK, [p / GIB for p in peaks]
    assert max(asleep) < peaks[0] - 1 * GIB, "sleep did not give the KV cache back"
