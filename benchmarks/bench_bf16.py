"""bf16 autocast vs float32 for the training pass on CPU: seconds per forward+backward and the log-prob gap.

For each model (the tiny Qwen3 and a random ~100M-parameter Qwen3, as benchmarks/bench_memory.py builds
them, `_common.MODELS`) it runs the trainer's own pass (`fspo.update.forward.log_probs`, packed one-row layout as in
training) on a synthetic rollout of 16 sequences (prompt 32 + response up to 96 tokens), forward and
backward of sum(logp * advantage), ``--repeats`` times after one warm-up, with ``ppo.autocast`` null
(float32) and ``bf16`` (torch.autocast(bfloat16), float32 master weights), and reports:

- ``s_fwd_bwd``: median seconds of one forward+backward;
- ``gap_mean`` / ``gap_max``: mean / max |logp_bf16 - logp_fp32| over response tokens (the rounding
  gap a bf16 trainer adds to every importance ratio; why ``ppo.old_log_probs=recompute`` is required).

    python benchmarks/bench_bf16.py                       # prints a table, writes .bench/bench_bf16.json
    python benchmarks/bench_bf16.py --models tiny --threads 2 --repeats 5

Whether bf16 pays on a CPU depends on its bf16 matrix units (AMX / AVX512-BF16); without them torch
emulates bf16 matmuls and they are slower than float32. The JSON records ``torch.backends.cpu.get_cpu_capability()``.
"""
from __future__ import annotations

import argparse
import statistics
from types import SimpleNamespace

from _common import MODELS, synthetic_rollout, timed, write_json


def measure(model_name: str, repeats: int) -> list:
    """[float32 row, bf16 row] for one model."""

    from fspo.models.segment_attention import enable_segment_attention
    from fspo.models.tiny import build_tiny_model
    from fspo.update import forward

    policy = build_tiny_model(seed=0, **MODELS[model_name]).train()
    enable_segment_attention(policy)
    batch = synthetic_rollout()
    mask = batch.response_mask.bool()
    rows, ref = [], None
    for autocast in (None, "bf16"):
        module = SimpleNamespace(policy=policy, ppo=SimpleNamespace(logprob_temperature=1.0, lm_head_chunk_rows=0,
                                                                    autocast=autocast))

        def fwd_bwd(module=module):
            lp, _ = forward.log_probs(module, batch, pack_width=0)
            (lp * batch.advantages[:, None]).sum().backward()
            return lp

        lp, times = timed(fwd_bwd, repeats, before=lambda: policy.zero_grad(set_to_none=True))
        lp = lp.detach()
        ref = lp if ref is None else ref
        gap = (lp - ref)[mask].abs()
        rows.append({"model": model_name, "params": sum(p.numel() for p in policy.parameters()),
                     "autocast": autocast or "fp32", "s_fwd_bwd": statistics.median(times),
                     "s_min": min(times), "s_max": max(times),
                     "gap_mean": float(gap.mean()), "gap_max": float(gap.max()),
                     "tokens": int(batch.prompt_mask.sum() + batch.response_mask.sum())})
    return rows


def main(argv=None) -> None:
    """Measure every model, print a table, write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,qwen3_100m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=".bench/bench_bf16.json")
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    rows = [r for m in a.models.split(",") for r in measure(m, a.repeats)]
    print(f"{'model':<11} {'params':>10} {'pass':>5} {'s fwd+bwd':>10} {'(min-max)':>15} {'tokens/s':>9} "
          f"{'gap mean':>9} {'gap max':>8}")
    for r in rows:
        print(f"{r['model']:<11} {r['params']:>10} {r['autocast']:>5} {r['s_fwd_bwd']:>10.3f} "
              f"{r['s_min']:>7.3f}-{r['s_max']:<7.3f} {r['tokens'] / r['s_fwd_bwd']:>9.0f} {r['gap_mean']:>9.2e} "
              f"{r['gap_max']:>8.2e}")
    out = {"rows": rows, "threads": a.threads, "torch": torch.__version__,
           "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    write_json(a.out, out)
    print(f"cpu capability {out['cpu_capability']}, {a.threads} threads")


if __name__ == "__main__":
    main()
