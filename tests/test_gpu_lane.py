"""The ``gpu`` lane: what only a CUDA device can get wrong. Every test skips without CUDA (conftest's
``gpu`` marker), the vLLM ones without vLLM, the multi-GPU ones on one GPU; CI never needs them.

Each catches a defect the CPU tests cannot see:
- vLLM's log-probs of its own samples after a weight sync equal the trainer's (a sync that misses or
  mis-maps a weight passes on CPU-free code paths only if the engine really holds the new weights), with
  CUDA graphs off and on (captured graphs must see the synced weights in place);
- meta-device init plus loading bf16 safetensors shards onto CUDA gives the saved weights;
- segment attention on CUDA SDPA (flash / memory-efficient kernels) equals the padded pass;
- HF generation under bf16 autocast on CUDA (the placement default without vLLM) samples from the policy;
- activation checkpointing on one CUDA device leaves gradients as they were;
- the flagship placement: ``+model=qwen3_1_7b`` (random weights, 2 layers) runs on the GPU by itself;
- the measured peak of a real step stays below the memory plan's;
- DCP save and resume on NCCL (trainer=fsdp), then the first step after it;
- LoRA under FSDP on CUDA; FSDP with vLLM on two GPUs (skips on one).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO, torchrun

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="needs vllm (pip install 'fspo[vllm]')")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
RUN = REPO / "experiments" / "run.py"
TINY_RUN = ["model.source=random", "steps=2", "prompts_per_step=4", "rollout.sampling.n=4", "ppo.mini_batch_size=8",
            "ppo.mini_batch_unit=sequences",
            "rollout.sampling.max_new_tokens=24", "val.size=0", "logger=csv", "progress.mode=off"]


def _policy(seed: int = 0):
    from fspo.models.tiny import build_tiny_model

    return build_tiny_model(seed=seed).cuda()


def _vllm_logprobs_after_sync(tmp_path, eager: bool, dtype: str):
    """(engine log-probs, trainer log-probs, response mask) of samples drawn after syncing new weights."""
    from fspo.models.tiny import build_tokenizer
    from fspo.rollout.base import SamplingConfig
    from fspo.rollout.vllm import VLLMEngine
    from fspo.update.logprobs import response_log_probs

    policy = _policy()
    engine = VLLMEngine(dtype=dtype, gpu_memory_utilization=0.2, enforce_eager=eager, max_model_len=256)
    engine.setup(policy, build_tokenizer(), str(tmp_path))
    try:
        with torch.no_grad():  # the trainer moves: the engine must follow through sync_weights alone
            for p in policy.parameters():
                p.add_(0.05 * torch.randn_like(p))
        engine.sync_weights(policy)
        batch = engine.generate([[5, 6, 7, 8], [9, 10, 11]], SamplingConfig(n=4, max_new_tokens=32, seed=0))
    finally:
        engine.shutdown()
    with torch.no_grad():
        lp, _ = response_log_probs(policy, batch.to("cuda"))
    return batch.engine_log_probs.cuda(), lp, batch.response_mask.bool().cuda()


@needs_vllm
def test_vllm_logprobs_after_a_sync_equal_the_trainers(tmp_path):
    eng, ref, mask = _vllm_logprobs_after_sync(tmp_path, eager=True, dtype="float32")
    assert mask.sum() > 0
    assert float((eng - ref)[mask].abs().max()) < 1e-3  # float32 both sides: kernel order only


@needs_vllm
def test_vllm_sync_with_cuda_graphs_on(tmp_path):
    eng, ref, mask = _vllm_logprobs_after_sync(tmp_path, eager=False, dtype="bfloat16")
    gap = (eng - ref)[mask].abs()
    assert float(gap.mean()) < 0.05  # bf16 engine vs float32 trainer; stale weights give gaps of ~1


def test_meta_init_and_bf16_safetensors_shards_load_on_cuda(tmp_path):
    from fspo.models.meta_init import build_on_meta, is_on_meta, load_local_shards

    src = _policy(seed=3).to(torch.bfloat16)
    src.save_pretrained(tmp_path, safe_serialization=True)
    model = build_on_meta(tmp_path, torch.float32)
    assert is_on_meta(model)
    load_local_shards(model, device="cuda", path=tmp_path)
    assert not is_on_meta(model)
    ref = dict(src.named_parameters())
    for name, p in model.named_parameters():
        assert p.device.type == "cuda" and p.dtype == torch.float32, name
        torch.testing.assert_close(p, ref[name].float(), atol=0, rtol=0, msg=name)


@pytest.mark.parametrize("packed", [False, True])
def test_segment_attention_on_cuda_sdpa_equals_the_padded_pass(packed):
    import fsdp_head_worker as hw

    from fspo.models.segment_attention import enable_segment_attention
    from fspo.update.logprobs import response_log_probs

    batch = hw.fsdp_worker.fixed_rollout().to("cuda")
    ref_model = hw.build_model(False).cuda()
    with torch.no_grad():
        ref, _ = response_log_probs(ref_model, batch, temperature=hw.TEMPERATURE)
        model = hw.build_model(False).cuda()
        enable_segment_attention(model)
        got, _ = response_log_probs(model, batch, temperature=hw.TEMPERATURE, pack_width=0 if packed else None)
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=0)


def test_hf_generation_under_bf16_autocast_samples_the_policy():
    from fspo.models.tiny import build_tokenizer
    from fspo.rollout.base import SamplingConfig
    from fspo.rollout.hf import HFEngine
    from fspo.update.logprobs import response_log_probs

    policy, engine = _policy(), HFEngine(autocast="bf16")
    engine.setup(policy, build_tokenizer(), "")
    batch = engine.generate([[5, 6, 7, 8]], SamplingConfig(n=8, max_new_tokens=24, seed=0))
    mask = batch.response_mask.bool()
    with torch.no_grad():
        ref, _ = response_log_probs(policy, batch.to("cuda"))
    gap = (batch.engine_log_probs.cuda() - ref)[mask.cuda()].abs()
    assert mask.sum() > 0 and float(gap.mean()) < 0.05  # bf16 matmuls: close to the float32 policy, not equal


def test_activation_checkpointing_on_one_cuda_device_keeps_the_gradients():
    from test_activation_checkpointing import _grads

    ref_lp, ref = _grads(_policy(), False)
    lp, got = _grads(_policy(), True)
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], atol=1e-5, rtol=1e-4, msg=n)


def _run(args, tmp_path, name="run", nproc=None):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               HF_HUB_OFFLINE="1")
    args = [*args, f"output_dir={tmp_path / name}", f"hydra.run.dir={tmp_path / name}"]
    if nproc:
        return torchrun(RUN, args, tmp_path / f"{name}_logs", nproc=nproc, cwd=tmp_path, env=env, timeout=900)
    proc = subprocess.run([sys.executable, str(RUN), *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return proc


def test_the_flagship_model_config_runs_on_the_gpu_by_itself(tmp_path):
    arch = ["model.arch.num_hidden_layers=2", "model.arch.hidden_size=256", "model.arch.intermediate_size=512",
            "model.arch.num_attention_heads=4", "model.arch.num_key_value_heads=2", "model.arch.head_dim=64",
            "model.arch.vocab_size=1024"]
    proc = _run(["+method=fspo", "+model=qwen3_1_7b", *TINY_RUN, *arch], tmp_path)
    assert "placement: trainer.accelerator=gpu" in proc.stderr + proc.stdout


def test_measured_peak_is_below_the_plan(tmp_path):
    from test_gpu_smoke import SCRIPT

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "smoke.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model", "qwen3_100m", "--steps", "1", "--out", str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-6000:]
    res = json.loads(out.read_text())
    from conftest import compose_config
    from fspo.runtime.launch.memory_plan import _plan
    from fspo.runtime.launch.placement import Machine, place

    over = ["+model=qwen3_100m", "trainer.accelerator=gpu", "ppo.autocast=bf16", "ppo.old_log_probs=recompute"]
    cfg = compose_config(over)
    place(cfg, over, Machine.detect())
    plan = _plan(cfg, None)[2]
    measured = max(r["peak_mib"] for r in res["phases"].values()) * 2**20
    assert measured <= plan.peak, (measured / 2**30, plan.describe())


def test_dcp_save_and_resume_on_nccl(tmp_path):
    n = min(2, torch.cuda.device_count())
    base = ["trainer=fsdp", *TINY_RUN, "checkpoint.every_n_steps=1"]
    _run(base, tmp_path, "dcp", nproc=n)
    assert list((tmp_path / "dcp" / "checkpoints").glob("step_000002*")), "no distributed checkpoint at step 2"
    _run([*[a for a in base if not a.startswith("steps=")], "steps=3", "resume=auto"], tmp_path, "dcp", nproc=n)
    assert list((tmp_path / "dcp" / "checkpoints").glob("step_000003*")), "the resumed run did not reach step 3"


def test_lora_under_fsdp_on_cuda(tmp_path):
    _run(["trainer=fsdp", "model.lora.rank=4", *TINY_RUN], tmp_path, "lora", nproc=min(2, torch.cuda.device_count()))


@needs_vllm
@two_gpus
def test_fsdp_with_vllm_on_two_gpus(tmp_path):
    _run(["trainer=fsdp", "rollout=vllm", "rollout.engine.gpu_memory_utilization=0.2", *TINY_RUN], tmp_path, "vllm",
         nproc=2)
