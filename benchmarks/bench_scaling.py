"""How the RL step time grows with response length and with G (group size).

Runs `benchmarks/bench.py` (a real training run per setting, median of the steps after the
first) on a random tiny Qwen3 with fixed-length responses (``min_new_tokens = max_new_tokens``,
so every response has exactly L tokens), over a grid of L at a fixed G and of G at a fixed L,
and prints a markdown table (step time, phase split, tokens/s, padding waste). Writes
``--out`` (JSON) and each run is in MLflow (experiment ``bench``).

    python benchmarks/bench_scaling.py                                   # L 64..2048 at G 8; G 4..16 at L 256
    python benchmarks/bench_scaling.py --lengths 64 128 --groups 4 --prompts 2 --steps 2
"""
from __future__ import annotations

import argparse

import bench  # benchmarks/bench.py, next to this script
from _common import write_json


def run(length: int, group: int, prompts: int, steps: int, extra) -> dict:
    overrides = ["model.source=random", f"++model.arch.max_position_embeddings={length + 64}",
                 f"prompts_per_step={prompts}", f"rollout.sampling.n={group}",
                 f"ppo.mini_batch_size={max(1, prompts * group // 4)}", *extra]
    res = bench.main(["--steps", str(steps), "--fixed-len", str(length),
                      "--out", f".bench/scaling_L{length}_G{group}.json", *overrides])
    return {"L": length, "G": group, **res}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 1024, 2048])
    ap.add_argument("--groups", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--fixed-group", type=int, default=8)
    ap.add_argument("--fixed-length", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=".bench/bench_scaling.json")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, after --")
    a = ap.parse_args(argv)
    grid = [(L, a.fixed_group) for L in a.lengths] + [(a.fixed_length, g) for g in a.groups if g != a.fixed_group]
    rows = [run(L, g, a.prompts, a.steps, a.overrides) for L, g in grid]
    print("\n| L | G | seqs | step s | generate | old logp | train | rollout tok/s | train tok/s | waste |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ph, tps = r["phases_s"], r["tokens_per_s"]
        print(f"| {r['L']} | {r['G']} | {r['rollout_batch']} | {r['step_time_s']:.2f} | {ph['generate']:.2f} | "
              f"{ph['old_log_probs']:.2f} | {ph['train']:.2f} | {tps['rollout'] or 0:.0f} | {tps['train'] or 0:.0f} | "
              f"{r['padding_waste']:.3f} |")
    write_json(a.out, rows)
    return rows


if __name__ == "__main__":
    main()
