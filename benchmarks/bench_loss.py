"""Benchmark: policy-loss forward + backward per clipping rule (B x T log-probs, ragged lengths).

Owns: timing of `rule(...)` + `aggregate(..., mode)` + `backward()` for every rule against a plain
token-level masked mean of -A exp(d) (no clipping), median of --reps runs after --warmup runs,
cases interleaved round-robin.
Prints a table and writes JSON (--out, default .bench/bench_loss.json). Leaves out: the model
forward/backward, which dominates a real step; this isolates the loss.

    .venv/bin/python benchmarks/bench_loss.py --B 128 --T 4096 --reps 15
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time
from typing import Callable, Dict

import torch
from _common import write_json

from fspo.clipping import FSPOClip, GRPOClip, GSPOClip, RLOOClip
from fspo.losses import aggregate


def baseline(lp, old, adv, mask, mode):
    """Plain token-level masked mean of -A exp(logp_new - logp_old): the floor any rule pays."""
    m = mask.bool()
    d = torch.where(m, lp.float() - old.float(), 0.0)
    return -(adv[:, None] * torch.exp(d) * m).sum() / m.sum()


def rule_loss(rule) -> Callable:
    def run(lp, old, adv, mask, mode):
        return aggregate(rule(lp, old, adv, mask).token_loss, mask, mode).loss
    return run


def ema_step(rule) -> Callable:
    """FSPO with the EMA band and KL drift, including the once-per-step `observe` update."""
    def run(lp, old, adv, mask, mode):
        res = rule(lp, old, adv, mask)
        loss = aggregate(res.token_loss, mask, mode).loss
        d = torch.where(mask.bool(), lp.detach().float() - old.float(), 0.0)
        rule.observe(res.seq_log_ratio, mask.sum(-1), d, mask)
        return loss
    return run


def build_cases(device: torch.device) -> Dict[str, Callable]:
    return {
        "baseline": baseline,
        "grpo": rule_loss(GRPOClip()),
        "rloo": rule_loss(RLOOClip()),
        "gspo": rule_loss(GSPOClip()),
        "fspo": rule_loss(FSPOClip()),
        "fspo_ema_kl": ema_step(FSPOClip(band="ema", drift="kl").to(device)),
    }


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_cases(cases: Dict[str, Callable], data, mode, reps, warmup, device) -> Dict[str, Dict]:
    """Round-robin over the cases (rep-major) so machine-load drift hits every case alike."""
    lp0, old, adv, mask = data
    times: Dict[str, list] = {name: [] for name in cases}
    for i in range(warmup + reps):
        for name, fn in cases.items():
            lp = lp0.detach().clone().requires_grad_(True)
            sync(device)
            t0 = time.perf_counter()
            fn(lp, old, adv, mask, mode).backward()
            sync(device)
            if i >= warmup:
                times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: {"median_ms": statistics.median(t), "min_ms": min(t), "max_ms": max(t)}
            for name, t in times.items()}


def make_data(B, T, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(T // 8, T + 1, (B,), generator=g)
    mask = (torch.arange(T) < lengths[:, None]).float()
    old = -torch.rand(B, T, generator=g) * 2
    lp = old + torch.randn(B, T, generator=g) * 0.05
    adv = torch.randn(B, generator=g)
    return (lp.to(device, dtype), old.to(device, dtype), adv.to(device), mask.to(device))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--B", type=int, default=128)
    ap.add_argument("--T", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--mode", default="token-mean")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave as is)")
    ap.add_argument("--out", default=".bench/bench_loss.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    data = make_data(args.B, args.T, getattr(torch, args.dtype), device)
    results = time_cases(build_cases(device), data, args.mode, args.reps, args.warmup, device)
    base, grpo = results["baseline"]["median_ms"], results["grpo"]["median_ms"]
    for r in results.values():
        r["vs_baseline"] = r["median_ms"] / base
        r["vs_grpo"] = r["median_ms"] / grpo
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    print(f"loss fwd+bwd, B={args.B} T={args.T} {args.dtype} mode={args.mode} device={dev_name} "
          f"threads={torch.get_num_threads()} reps={args.reps}")
    print(f"{'rule':<13}{'median ms':>11}{'min ms':>9}{'x baseline':>12}{'x grpo':>9}")
    for name, r in results.items():
        print(f"{name:<13}{r['median_ms']:>11.2f}{r['min_ms']:>9.2f}{r['vs_baseline']:>12.2f}{r['vs_grpo']:>9.2f}")
    ratio = results["fspo"]["median_ms"] / grpo
    print(f"FSPO / GRPO = {ratio:.2f} (goal <= 1.3)")
    write_json(args.out, {"config": vars(args), "device": dev_name, "torch": torch.__version__,
                          "threads": torch.get_num_threads(), "results": results, "fspo_over_grpo": ratio}, indent=2)


if __name__ == "__main__":
    main()
