"""Meta-device building and per-rank shard loading (fspo/models/meta_init.py), used by trainer=fsdp.

Single process: the warm start built on meta holds no parameter memory, and `load_local_shards`
fills it to exactly the model `from_pretrained` loads (parameters, rotary buffers, logits); a hub id
in the local cache takes the same path (the cache is a folder laid out as huggingface_hub writes it;
``constants.HF_HUB_CACHE`` pointed at it), a folder without safetensors the old full load.
Two processes (gloo, CPU; ``torchrun`` through benchmarks/bench_fsdp_load_memory.py): each rank's
FSDP2 shards equal its rows of the saved file, and each rank holds half of the model.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO
from fspo.models.loading import WARMSTART_DIR, load_policy
from fspo.models.meta_init import is_on_meta, load_local_shards


def test_meta_build_then_load_equals_from_pretrained():
    ref, _ = load_policy(source="warmstart")
    model, tok = load_policy(source="warmstart", meta=True)
    assert is_on_meta(model) and all(p.is_meta for p in model.parameters())
    assert model.model.rotary_emb.inv_freq.device.type == "cpu"  # buffers stay real
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, one parameter
    n = load_local_shards(model, "cpu")
    assert n == sum(p.numel() for p in ref.parameters()) and not is_on_meta(model)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ref_sd = ref.state_dict()
    for k, v in model.state_dict().items():
        assert torch.equal(v, ref_sd[k]), k
    ids = torch.tensor([tok.encode("Q:2+7\nA:")])
    assert torch.equal(model(ids).logits, ref(ids).logits)


def test_unsharded_module_loads_a_meta_policy_whole():
    """configure_sharding without a ModelParallelStrategy (one device) materialises the meta policy."""
    from fspo.runtime.launch.distributed import configure_sharding

    class Holder(torch.nn.Module):
        device = torch.device("cpu")

    holder = Holder()
    holder.policy, _ = load_policy(source="warmstart", meta=True)
    configure_sharding(holder)
    assert not is_on_meta(holder.policy)


def test_missing_weights_folder_is_one_clear_line(tmp_path):
    model, _ = load_policy(source="warmstart", meta=True)
    (tmp_path / "config.json").write_text((WARMSTART_DIR / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="has no model.safetensors"):
        load_local_shards(model, "cpu", tmp_path)


@pytest.mark.distributed
@pytest.mark.slow
def test_two_ranks_each_read_their_shard(tmp_path):
    out = tmp_path / "bench.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, str(REPO / "benchmarks" / "bench_fsdp_load_memory.py"), "--mode", "meta",
           "--hidden", "128", "--layers", "2", "--vocab", "1001",  # odd: uneven shards (501 / 500 rows)
           "--weights", str(tmp_path / "w"), "--out", str(out)]
    proc = subprocess.run(cmd, env=env, cwd=str(REPO), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    rows = res["modes"]["meta"]
    assert [r["rank"] for r in rows] == [0, 1]
    for r in rows:
        assert r["max_abs_diff_vs_file"] == 0.0  # every shard equals its rows of the file
        assert r["local_shard_mib"] == pytest.approx(res["model_fp32_mib"] / 2, abs=0.1)  # rounded to 0.1 MiB


def test_hub_id_in_the_local_cache_is_built_on_meta(tmp_path, monkeypatch):
    """A hub id whose snapshot is in the cache (a cache folder laid out as huggingface_hub writes it)."""
    import shutil

    from huggingface_hub import constants

    snap = tmp_path / "models--org--tiny" / "snapshots" / "abc123"
    shutil.copytree(WARMSTART_DIR, snap)
    (tmp_path / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "models--org--tiny" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, _ = load_policy(source="pretrained", hub_id="org/tiny", meta=True)
    assert is_on_meta(model) and model._fspo_weights_dir == str(snap)
    load_local_shards(model, "cpu")
    ref, _ = load_policy(source="warmstart")
    assert all(torch.equal(v, ref.state_dict()[k]) for k, v in model.state_dict().items())


def test_folder_without_safetensors_is_refused(tmp_path):
    """pytorch_model.bin is a pickle, which can run code when loaded: refused with one line, on every path."""
    ref, tok = load_policy(source="warmstart")
    ref.save_pretrained(str(tmp_path))
    tok.save_pretrained(str(tmp_path))
    (tmp_path / "model.safetensors").unlink()  # pytorch_model.bin only
    torch.save(ref.state_dict(), tmp_path / "pytorch_model.bin")
    for meta in (True, False):
        with pytest.raises(ValueError, match="pytorch_model.bin.*safetensors only"):
            load_policy(source="pretrained", path=str(tmp_path), meta=meta)