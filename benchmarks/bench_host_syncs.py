"""Benchmark: host syncs and kernel launches per RL step of the update (`RLModule.training_step`), on CPU.

Owns: counting, during each training step of a short real run (fspo.train.train on the tiny model or a
random Qwen3 shape), (1) the tensor-to-host reads, each a device sync on a GPU: ``Tensor.item``,
``float()``, ``int()``, ``bool()`` and ``tolist()`` of a tensor, and (2) the aten operators dispatched,
forward and backward (on a GPU each is about one kernel launch; TorchDispatchMode). Prints the per-step
means and writes JSON (--out, default .bench/bench_host_syncs.json). Leaves out: generation, rewards and
validation (outside the training step), and timing (a CPU count is exact, a CPU time is not the GPU's).

    python benchmarks/bench_host_syncs.py --steps 3
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
from collections import Counter
from pathlib import Path
from typing import Dict, List

import torch
from _common import compose, write_json
from torch.utils._python_dispatch import TorchDispatchMode

READS = ("item", "__float__", "__int__", "__bool__", "tolist")


class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def count_step(step, counts: List[Dict[str, int]]):
    """``step`` wrapped: each call's host reads (by kind) and aten operators appended to ``counts``."""
    def wrapped(*args, **kwargs):
        reads: Counter = Counter()
        saved = {name: getattr(torch.Tensor, name) for name in READS}

        def counting(name):
            orig = saved[name]

            def f(self, *a, **k):
                reads[name] += 1
                return orig(self, *a, **k)
            return f

        for name in READS:
            setattr(torch.Tensor, name, counting(name))
        ops = _OpCounter()
        try:
            with ops:
                return step(*args, **kwargs)
        finally:
            for name, orig in saved.items():
                setattr(torch.Tensor, name, orig)
            counts.append({"host_reads": sum(reads.values()), "aten_ops": ops.ops, **dict(reads)})
    return wrapped


def main(argv=None) -> Dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=".bench/bench_host_syncs.json")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides")
    a = ap.parse_args(argv)
    from fspo.train import train
    from fspo.update.module import RLModule

    counts: List[Dict[str, int]] = []
    original = RLModule.training_step
    RLModule.training_step = count_step(original, counts)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            cfg = compose(["model.source=random", f"steps={a.steps}", "prompts_per_step=4", "rollout.sampling.n=4",
                           "ppo.mini_batch_size=8", "ppo.mini_batch_unit=sequences", "ppo.micro_batch_max_tokens=64",
                           "rollout.sampling.max_new_tokens=24",
                           "val.size=0", "logger=csv", "progress.mode=off", "checkpoint.every_n_steps=0",
                           f"output_dir={tmp}/out", *a.overrides])
            train(cfg)
    finally:
        RLModule.training_step = original
    keys = sorted({k for c in counts for k in c})
    mean = {k: statistics.mean(c.get(k, 0) for c in counts) for k in keys}
    print(f"bench_host_syncs: {len(counts)} training steps; per step: "
          + ", ".join(f"{k} {v:g}" for k, v in mean.items()))
    res = {"steps": counts, "mean": mean, "overrides": a.overrides}
    write_json(Path(a.out), res)
    return res


if __name__ == "__main__":
    main()
