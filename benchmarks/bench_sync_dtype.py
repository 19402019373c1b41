"""The weight sync's all-gather under FSDP2, float32 masters into a bfloat16 engine: bytes on the wire,
the largest gathered tensor and seconds per sync, gathering float32 and casting after versus casting each
shard first (fspo/models/gather.py).

    python benchmarks/bench_sync_dtype.py --model qwen3_100m --repeats 3

Runs itself on 2 gloo ranks (torchrun); each rank builds the random model, shards it with fully_shard and
drains the sync's weight stream both ways, counting every DTensor.full_tensor call's bytes. Rank 0 prints
one line per mode and writes the JSON to ``--out``. Bytes are counted, seconds measured (median of the
repeats after one warm-up; a shared CPU is noisy, compare rows of one run).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

from _common import MODELS, child_row, emit_row, timed, torchrun, write_json


def _child(model_name: str, repeats: int) -> None:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from fspo.models.tiny import build_tiny_model
    from fspo.rollout.weights import engine_weights

    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo")
    world = torch.distributed.get_world_size()
    model = build_tiny_model(seed=0, **MODELS[model_name])
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    calls, orig = [], DTensor.full_tensor

    def counting(self, *a, **k):
        calls.append(self.numel() * self.dtype.itemsize)
        return orig(self, *a, **k)

    DTensor.full_tensor = counting
    modes = {"gather_float32_then_cast": lambda: [t.to(torch.bfloat16) for _, t in engine_weights(model)][-1],
             "cast_shards_then_gather": lambda: [t for _, t in engine_weights(model, torch.bfloat16)][-1]}
    rows = {}
    for name, fn in modes.items():
        with torch.no_grad():
            calls.clear()
            fn()
            wire, largest = sum(calls), max(calls)
            _, secs = timed(fn, repeats)
        rows[name] = {"gathered_bytes": wire, "largest_gathered_bytes": largest, "seconds": statistics.median(secs),
                      "params": sum(p.numel() for p in model.parameters())}
    if torch.distributed.get_rank() == 0:
        emit_row(rows)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3_100m", choices=sorted(MODELS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=".bench/sync_dtype.json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        _child(args.model, args.repeats)
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    row, proc = child_row([*torchrun(2), os.path.abspath(__file__), "--child", "--model", args.model,
                           "--repeats", str(args.repeats)], env=env, timeout=1800)
    if row is None:
        sys.exit(f"the 2-rank run failed:\n{proc.stderr[-4000:]}")
    for name, r in row.items():
        print(f"{name:26s} params {r['params'] / 1e6:.1f}M  gathered {r['gathered_bytes'] / 2**20:8.1f} MiB  "
              f"largest {r['largest_gathered_bytes'] / 2**20:6.1f} MiB  {r['seconds']:.3f} s/sync")
    write_json(args.out, {"model": args.model, "world": 2, "repeats": args.repeats, "modes": row})


if __name__ == "__main__":
    main()
