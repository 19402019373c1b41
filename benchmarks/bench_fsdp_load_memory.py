"""Peak host memory per rank while loading a policy under trainer=fsdp: meta device + per-rank safetensors
slices (fspo/models/meta_init.py) versus the old path (every rank builds the full model, then shards).

    python benchmarks/bench_fsdp_load_memory.py                      # ~100M Qwen3, 2 ranks, both paths
    python benchmarks/bench_fsdp_load_memory.py --mode meta --hidden 128 --layers 2 --vocab 1000

Without torchrun it saves a random Qwen3 (hidden 768, 12 layers, vocab 32k: ~100M parameters, fp32) with
``save_pretrained`` into ``--weights`` (once), then launches ``torchrun --nproc_per_node=N`` on itself
for each mode. Each rank (gloo, CPU) reads ru_maxrss before and after: build the policy
(`load_policy(..., meta=...)`), shard it with FSDP2 (`shard_model`), fill the shards
(`load_local_shards` on the meta path), after a warm-up that builds and shards the tiny model (the
one-time import cost, ~230 MiB, is in the baseline, not the load); it then checks the parameters
all-gathered from the shards against the file. Prints a table and writes JSON (``--out``): peak RSS
per rank (MiB), the part of it added by loading, the model's size.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
from pathlib import Path

from _common import maxrss_mib, rss_mib, torchrun, write_json


def save_model(path: Path, hidden: int, layers: int, vocab: int) -> int:
    from fspo.models.tiny import build_tiny_model, build_tokenizer

    model = build_tiny_model(seed=0, vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                             num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 192),
                             head_dim=64, intermediate_size=hidden * 8 // 3)
    if not (path / "config.json").exists():
        model.save_pretrained(str(path))
        build_tokenizer().save_pretrained(str(path))
    return sum(p.numel() for p in model.parameters())


def worker(weights: Path, mode: str, out: Path) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    import gc

    from fspo.models.loading import load_policy
    from fspo.models.meta_init import load_local_shards
    from fspo.models.tiny import build_tiny_model
    from fspo.runtime.launch.distributed import ShardingConfig, shard_model

    # warm-up: transformers' and FSDP's one-time cost (lazy imports, ~230 MiB) paid before the baseline,
    # by building and sharding the ~1M-parameter tiny Qwen3 (4 MiB)
    shard_model(build_tiny_model(), init_device_mesh("cpu", (world,)), ShardingConfig())
    gc.collect()
    base_rss, base_peak = rss_mib(), maxrss_mib()
    model, _ = load_policy(source="pretrained", path=str(weights), meta=mode == "meta")
    shard_model(model, init_device_mesh("cpu", (world,)), ShardingConfig())
    if mode == "meta":
        load_local_shards(model, "cpu")
    gc.collect()
    peak, after = maxrss_mib(), rss_mib()
    # correctness (after the peak was read): every parameter all-gathered from the shards equals the file
    from safetensors import safe_open

    with safe_open(str(weights / "model.safetensors"), "pt") as f:
        worst = 0.0
        for name, p in model.named_parameters():
            worst = max(worst, float((p.full_tensor() - f.get_tensor(name)).abs().max()))
    local = sum(p.to_local().numel() * p.element_size() for p in model.parameters()) / 2**20
    row = dict(rank=rank, mode=mode, peak_rss_mib=round(peak, 1), baseline_rss_mib=round(base_rss, 1),
               baseline_peak_mib=round(base_peak, 1), added_by_loading_mib=round(peak - max(base_rss, 0), 1),
               rss_after_mib=round(after, 1), local_shard_mib=round(local, 1), max_abs_diff_vs_file=worst)
    rows = [None] * world
    dist.all_gather_object(rows, row)
    if rank == 0:
        out.write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", default="/tmp/fspo_bench_qwen3_100m", help="folder of the saved random model")
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--mode", choices=["meta", "full", "both"], default="both",
                    help="meta: the new path; full: the old one (every rank loads the whole model)")
    ap.add_argument("--out", default="experiments/results/fsdp_load_memory.json")
    ap.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    weights = Path(a.weights)
    if a._worker:
        return worker(weights, a.mode, Path(a._worker))
    n_params = save_model(weights, a.hidden, a.layers, a.vocab)
    model_mib = n_params * 4 / 2**20
    result = dict(n_params=n_params, model_fp32_mib=round(model_mib, 1), ranks=a.ranks, modes={})
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for mode in (["meta", "full"] if a.mode == "both" else [a.mode]):
        tmp = Path(f"/tmp/fspo_bench_load_{mode}_{os.getpid()}.json")
        cmd = [*torchrun(a.ranks), __file__, "--weights", str(weights), "--mode", mode, "--_worker", str(tmp)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"torchrun ({mode}) failed:\n{proc.stderr[-3000:]}")
        result["modes"][mode] = json.loads(tmp.read_text())
        tmp.unlink()
    print(f"model: {n_params / 1e6:.1f}M parameters, {model_mib:.1f} MiB in fp32, {a.ranks} ranks (gloo, CPU)")
    print(f"{'mode':6} {'rank':>4} {'peak RSS':>10} {'baseline':>10} {'added':>8} {'shard':>8} "
          f"{'max|diff|':>10}  (MiB)")
    for mode, rows in result["modes"].items():
        for r in rows:
            print(f"{mode:6} {r['rank']:>4} {r['peak_rss_mib']:>10} {r['baseline_rss_mib']:>10} "
                  f"{r['added_by_loading_mib']:>8} {r['local_shard_mib']:>8} {r['max_abs_diff_vs_file']:>10.1e}")
    write_json(a.out, result)


if __name__ == "__main__":
    main()
