"""RL step benchmark: per-step time breakdown and throughput of a real training run.

Runs `fspo.train.train` for ``--steps`` steps (validation off) with any Hydra overrides, then
reads the per-step metrics the run logged to MLflow and prints, per phase, the median seconds
per step (steps after the first, which pays one-off warm-up costs) and its share of the step:

    generate | weight_sync | reward | old_log_probs | train | metrics

plus tokens/s of each pass (rollout: response tokens / generate; old log-probs and training:
real prompt + response tokens / pass time), padding waste of the forward passes (padded slots /
real tokens), loss + metrics share of the step, and peak memory (CUDA max allocated, or the
process's peak RSS on CPU). Results are written as JSON (``--out``), logged to the MLflow run
(metrics ``bench/*`` and the JSON as an artifact; experiment ``bench``).

    python benchmarks/bench.py --steps 6                      # the embedded default
    python benchmarks/bench.py --steps 4 --model qwen3_100m   # a random ~100M-parameter Qwen3
    python benchmarks/bench.py --steps 6 -- +method=grpo rollout.sampling.n=16
    python benchmarks/bench.py --steps 3 --fixed-len 512 -- model.source=random  # every response 512 tokens
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from _common import PHASES, compose, latest_run, metric_history, write_json


def _rate(tokens, seconds):
    return tokens / seconds if tokens == tokens and tokens and seconds and seconds == seconds else None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", default=".bench/bench_step.json")
    ap.add_argument("--tracking-uri", default=None, help="MLflow URI (default: a temporary SQLite store)")
    ap.add_argument("--model", default=None, help="conf/model option (tiny, qwen3_100m, ...)")
    ap.add_argument("--fixed-len", type=int, default=None,
                    help="force every response to this many tokens (min = max new tokens)")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, after --")
    a = ap.parse_args(argv)

    import mlflow

    tmp = tempfile.mkdtemp(prefix="fspo_bench_")
    uri = a.tracking_uri or f"sqlite:///{tmp}/mlflow.db"
    extra = [f"+model={a.model}"] if a.model else []
    if a.fixed_len:
        extra += [f"rollout.sampling.max_new_tokens={a.fixed_len}", f"rollout.sampling.min_new_tokens={a.fixed_len}"]
    cfg = compose([f"steps={a.steps}", "val.size=0", f"output_dir={tmp}/run", f"logger.tracking_uri={uri}",
                   "logger.experiment_name=bench", *extra, *a.overrides])
    from fspo.train import train

    t0 = time.perf_counter()
    train(cfg)
    wall = time.perf_counter() - t0
    client = mlflow.MlflowClient(uri)
    run = latest_run(client, "bench")

    def hist(key):
        return metric_history(client, run.info.run_id, key)

    def med(key):
        h = hist(key)
        h = h[1:] if len(h) > 1 else h  # drop the warm-up step
        return statistics.median(h) if h else float("nan")

    phases = {p: med(f"time/{p}") for p in PHASES}
    total = sum(v for v in phases.values() if v == v)
    res = {
        "overrides": a.overrides, "steps": a.steps, "wall_s": wall, "mlflow_run_id": run.info.run_id,
        "step_time_s": total, "phases_s": phases,
        "phases_share": {p: v / total for p, v in phases.items()},
        "response_tokens_per_s": med("perf/response_tokens_per_s"),
        "rollout_batch": int(cfg.prompts_per_step) * int(cfg.rollout.sampling.n),
        "response_len_mean": med("rollout/response_len_mean"),
        "tokens_per_s": {
            "rollout": _rate(med("rollout/response_len_mean") * int(cfg.prompts_per_step) * int(cfg.rollout.sampling.n),
                             phases["generate"]),
            "old_log_probs": _rate(med("perf/old_log_probs_tokens"), phases["old_log_probs"]),
            "train": _rate(med("perf/train_tokens"), phases["train"]),
        },
        "padding_waste": med("perf/padding_waste"),
        "loss_metrics_share": med("perf/loss_metrics_share"),
        "peak_memory_mib": max(hist("perf/peak_memory_mib") or [float("nan")]),
    }
    print(f"{'phase':<15}{'median s/step':>15}{'share':>8}")
    for p in PHASES:
        print(f"{p:<15}{phases[p]:>15.3f}{res['phases_share'][p]:>8.1%}")
    print(f"{'total':<15}{total:>15.3f}")
    print(f"rollout batch {res['rollout_batch']} sequences, mean response {res['response_len_mean']:.1f} tokens, "
          f"{res['response_tokens_per_s']:.0f} response tokens/s per step")
    print("tokens/s: " + ", ".join(f"{k} {v:.0f}" for k, v in res["tokens_per_s"].items() if v))
    print(f"padding waste {res['padding_waste']:.3f}, loss + metrics {res['loss_metrics_share']:.2%} of the step, "
          f"peak memory {res['peak_memory_mib']:.0f} MiB")
    write_json(a.out, res)
    client.log_dict(run.info.run_id, res, "bench_step.json")
    flat = {"bench/step_time_s": total, "bench/padding_waste": res["padding_waste"],
            "bench/loss_metrics_share": res["loss_metrics_share"], "bench/peak_memory_mib": res["peak_memory_mib"],
            **{f"bench/tokens_per_s_{k}": v for k, v in res["tokens_per_s"].items() if v},
            **{f"bench/share_{p}": v for p, v in res["phases_share"].items() if v == v}}
    for k, v in flat.items():
        client.log_metric(run.info.run_id, k, float(v))
    return res


if __name__ == "__main__":
    main()
