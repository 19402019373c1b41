"""The weight sync gathers in the engine's dtype (fspo/models/gather.py, fspo/rollout/weights.py).

An FSDP2-sharded float32 policy synced into a bfloat16 engine: every DTensor is cast shard by shard and
crosses the all-gather in bfloat16 (half the bytes of the float32 gather), and the gathered values equal
the float32 gather cast afterwards, bit for bit (rounding acts per element, so it commutes with the
concatenation of shards); for a LoRA policy the merged weights equal the float32 merge of the whole
tensors rounded once. Two gloo processes; the one-process reference is built in each of them.
"""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from conftest import spawn_ranks
from fspo.models.gather import gathered, wire_dtype
from fspo.models.lora import LoRASettings, apply_lora, merged_weights
from fspo.models.tiny import build_tiny_model
from fspo.rollout.weights import engine_weights

BF16, F32 = torch.bfloat16, torch.float32
ARCH = {"vocab_size": 101}  # 101 embedding rows over 2 ranks: uneven shards (51 + 50)


def _lora_policy():
    """The tiny model with LoRA r 4 whose adapters have moved (B != 0), deterministic."""
    torch.manual_seed(0)
    model = apply_lora(build_tiny_model(seed=3, **ARCH), LoRASettings(rank=4, alpha=8.0))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model


def _shard(model, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for layer in [m for n, m in model.named_modules() if n.endswith("layers")][0]:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _recorded(fn):
    """``(result of fn(), [(dtype, numel) of every DTensor.full_tensor call, in order])``."""
    from torch.distributed.tensor import DTensor

    seen, orig = [], DTensor.full_tensor

    def recording(self, *a, **k):
        seen.append((self.dtype, self.numel()))
        return orig(self, *a, **k)

    DTensor.full_tensor = recording
    try:
        return fn(), seen
    finally:
        DTensor.full_tensor = orig


def _worker(rank, world, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    ref = build_tiny_model(seed=3, **ARCH)
    plain, plain_gathers = _recorded(lambda: dict(engine_weights(_shard(build_tiny_model(seed=3, **ARCH), world),
                                                                 BF16)))
    ref_sd = ref.state_dict()
    plain_exact = sorted(k for k in ref_sd if plain[k].dtype == BF16 and torch.equal(plain[k], ref_sd[k].to(BF16)))
    full32 = sum(n for _, n in plain_gathers) * 4  # what the float32 gather would have moved, in bytes
    lora_ref = {k: v.to(BF16) for k, v in merged_weights(_lora_policy())}  # whole tensors, float32 merge, one rounding
    lora, lora_gathers = _recorded(lambda: dict(engine_weights(_shard(_lora_policy(), world), BF16)))
    lora_exact = sorted(k for k in lora_ref if lora[k].dtype == BF16 and torch.equal(lora[k], lora_ref[k]))
    queue.put((rank, {"plain_exact": plain_exact, "plain_keys": sorted(ref_sd), "plain_gathers": plain_gathers,
                      "full32_bytes": full32, "lora_exact": lora_exact, "lora_keys": sorted(lora_ref),
                      "lora_gathers": lora_gathers}))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    queue.close()
    queue.join_thread()
    os._exit(0)


@pytest.fixture(scope="module")
def two_ranks():
    return spawn_ranks(_worker, lambda r, port, queue: (r, 2, port, queue))


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp_shards_cross_the_gather_in_the_engine_dtype(two_ranks):
    for rank in (0, 1):
        got = two_ranks[rank]
        assert got["plain_gathers"], "no DTensor was gathered: the model was not sharded"
        assert {d for d, _ in got["plain_gathers"]} == {BF16}  # cast before the collective, not after
        sent = sum(n * 2 for _, n in got["plain_gathers"])
        assert sent * 2 == got["full32_bytes"]  # half the bytes of gathering the float32 masters
        assert got["plain_exact"] == got["plain_keys"]  # = the float32 gather cast to bf16, bit for bit


@pytest.mark.distributed
@pytest.mark.slow
def test_lora_merges_in_float32_per_shard_and_gathers_bf16(two_ranks):
    for rank in (0, 1):
        got = two_ranks[rank]
        wide = [(d, n) for d, n in got["lora_gathers"] if d != BF16]
        # only the adapters' A (4 rows x 128 or 512 columns) travels in float32; every weight crosses in bf16
        assert wide and all(d == F32 and n in (4 * 128, 4 * 512) for d, n in wide), wide
        assert len(got["lora_gathers"]) - len(wide) == len(got["lora_keys"])
        assert got["lora_exact"] == got["lora_keys"]  # = merged whole in float32 and rounded once


def test_wire_dtype_narrows_never_widens():
    assert wire_dtype(F32, BF16) == BF16 and wire_dtype(BF16, F32) == BF16  # a wider engine widens its own copy
    assert wire_dtype(F32, None) == F32 and wire_dtype(torch.int64, BF16) == torch.int64
    x = torch.randn(3, 5)
    assert gathered(x, BF16).dtype == BF16 and torch.equal(gathered(x, BF16), x.to(BF16))
    assert not gathered(x.requires_grad_()).requires_grad and torch.equal(gathered(x), x)  # detached, same values


def test_one_process_engine_weights_in_engine_dtype():
    model = build_tiny_model(seed=3)
    got = dict(engine_weights(model, BF16))
    assert all(v.dtype == BF16 for v in got.values())
    assert all(torch.equal(got[k], v.to(BF16)) for k, v in model.state_dict().items())
    lora = _lora_policy()
    merged = dict(engine_weights(lora, BF16))
    assert merged.keys() == dict(merged_weights(lora)).keys()
    assert all(torch.equal(merged[k], v.to(BF16)) for k, v in merged_weights(lora))


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                    reason="vllm is not installed here; run `bash .ci/install_vllm_cpu.sh` and "
                    "`.venv-vllm/bin/python -m pytest tests/test_weight_sync_dtype.py`")
def test_vllm_sync_streams_the_engine_dtype(tmp_path, monkeypatch):
    """A bfloat16 vLLM engine (vllm-cpu) on a float32 LoRA policy: `sync_weights` asks for its own dtype, the
    weights reach vLLM in it, and the engine then serves the policy (dummy weights would sample near-uniformly)."""
    from test_vllm_engine import hf_response_logprobs, mean_abs

    import fspo.rollout.vllm as engine_module
    from fspo.models.tiny import build_tokenizer
    from fspo.rollout.base import SamplingConfig

    seen, stream = [], engine_module.engine_weights

    def recorded(model, dtype=None):
        for name, t in stream(model, dtype):
            seen.append(t.dtype)
            yield name, t

    monkeypatch.setattr(engine_module, "engine_weights", recorded)
    policy, tok = _lora_policy(), build_tokenizer()
    engine = engine_module.VLLMEngine(dtype="bfloat16", enforce_eager=True, max_model_len=128, kv_cache_space=0.05)
    engine.setup(policy, tok, str(tmp_path))
    try:
        engine.sync_weights(policy)
        assert engine.weight_dtype == BF16 and seen and set(seen) == {BF16}
        b = engine.generate([tok.encode("3+4=")], SamplingConfig(n=4, max_new_tokens=8, seed=1))
        gap = mean_abs(hf_response_logprobs(policy, b) - b.engine_log_probs, b.response_mask)
        print(f"BF16_SYNC_GAP {gap:.3e}")
        assert gap < 0.05, gap  # bf16 weights against the float32 policy; dummy weights: ~4
    finally:
        engine.shutdown()
