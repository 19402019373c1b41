"""N real RL steps of a model config, with tokens/s, MFU and peak memory per phase: generate, old log-probs, update.

    python experiments/gpu_smoke.py --model qwen3_1_7b --steps 3                 # a GPU (bf16 compute, fp32 masters)
    python experiments/gpu_smoke.py --model qwen3_100m --steps 3 -- rollout=vllm  # extra Hydra overrides after --
    python experiments/gpu_smoke.py --model tiny --steps 2 --peak-tflops 1.0      # CPU (what the tests run)

It runs `fspo.train.train` (CSV logger, no validation, ``ppo.old_log_probs=recompute``) and times each call of
the engine's ``generate``, `fspo.update.forward.old_log_probs` and `RLModule._update`, recording per call:

- seconds and tokens: generate counts prompt + response tokens (each passes the model once with the
  KV cache) and reports response tokens/s; old log-probs and update count the prompt + response tokens
  of the rows they compute;
- FLOPs: forward 2 x M per token + 2 x layers x q x S per token for causal attention (q = heads x
  head_dim, S the sequence's length), M the matmul parameters (decoder layers + the LM head; the
  embedding lookup is free); the update is 3 x forward (backward = 2 x forward);
- MFU = FLOPs / seconds / (``--peak-tflops`` x 1e12); on CUDA the default peak is the dense bf16 number
  of the card (`PEAK_TFLOPS`), elsewhere MFU is printed only with ``--peak-tflops``;
- peak memory: CUDA ``max_memory_allocated`` since the phase started; CPU the process's RSS high-water
  mark, reset before the phase (/proc/self/clear_refs) where Linux allows it.
A JSON of every phase call goes to ``--out``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}  # dense bf16, SXM
PHASES = ("generate", "old_log_probs", "update")


def _rss_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Meter:
    """Per-phase records: seconds, tokens, FLOPs, peak memory (module docstring)."""

    def __init__(self, shape, cuda: bool):
        self.shape, self.cuda, self.rows = shape, cuda, []
        s = shape
        self.matmul = s.layers * (s.layer_params - 2 * s.hidden - 2 * s.head_dim) + s.vocab * s.hidden
        self.q = s.heads * s.head_dim

    def fwd_flops(self, tokens: float, token_x_len: float) -> float:
        """2 M per token + causal attention 2 x layers x q x S per token (``token_x_len`` = sum over tokens of S)."""
        return 2 * self.matmul * tokens + 2 * self.shape.layers * self.q * token_x_len

    def start(self):
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            with contextlib.suppress(OSError):
                Path("/proc/self/clear_refs").write_text("5")
        return time.perf_counter()

    def stop(self, phase: str, t0: float, tokens: float, flops: float, counted: float) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
        secs = time.perf_counter() - t0
        peak = torch.cuda.max_memory_allocated() / 2**20 if self.cuda else _rss_mib("VmHWM")
        self.rows.append(dict(phase=phase, seconds=secs, tokens=tokens, counted_tokens=counted, flops=flops,
                              peak_mib=peak))
        print(f"gpu_smoke: {phase} {secs:.2f} s, {counted:.0f} tokens, {flops / 1e12:.1f} TFLOP, peak {peak:.0f} MiB",
              flush=True)  # each call as it ends: a run stopped early keeps what it measured


def _seq_tokens(batch):
    """(tokens, sum over tokens of their sequence's length) of a RolloutBatch's prompt + response rows."""
    lens = (batch.prompt_mask.sum(-1) + batch.lengths).double()
    return float(lens.sum()), float((lens * lens).sum())


def instrument(meter: Meter) -> None:
    """Wrap the three phases of this process (module docstring)."""
    import torch

    from fspo.rollout.hf import HFEngine
    from fspo.update import forward
    from fspo.update.module import RLModule

    engines = [HFEngine]
    with contextlib.suppress(ImportError):
        from fspo.rollout.vllm import VLLMEngine
        engines.append(VLLMEngine)
    for cls in engines:
        gen = cls.generate

        def generate(self, prompt_token_ids, params, _gen=gen):
            t0 = meter.start()
            out = _gen(self, prompt_token_ids, params)
            tok, txl = _seq_tokens(out)
            meter.stop("generate", t0, tok, meter.fwd_flops(tok, txl), float(out.lengths.sum()))
            return out
        cls.generate = generate

    old = forward.old_log_probs

    def old_log_probs(module, batch, usage=None, skip=None):
        t0 = meter.start()
        out = old(module, batch, usage=usage, skip=skip)
        keep = torch.ones(batch.batch_size, dtype=torch.bool)
        if skip is not None and skip.numel():
            keep[skip.cpu()] = False
        tok, txl = _seq_tokens(batch.select(torch.nonzero(keep).flatten().to(batch.response_ids.device)))
        meter.stop("old_log_probs", t0, tok, meter.fwd_flops(tok, txl), tok)
        return out
    forward.old_log_probs = old_log_probs

    upd = RLModule._update

    def _update(self, mb, opt, stats, on_policy, rows=None, **kw):
        t0 = meter.start()
        upd(self, mb, opt, stats, on_policy, rows=rows, **kw)
        tok, txl = _seq_tokens(mb if rows is None else mb.select(rows.to(mb.response_ids.device)))
        meter.stop("update", t0, tok, 3 * meter.fwd_flops(tok, txl), tok)
    RLModule._update = _update


def summarize(rows, peak_tflops):
    """{phase: {seconds, tokens_per_s, tflops, mfu, peak_mib}} over every call of each phase."""
    out = {}
    for phase in PHASES:
        rs = [r for r in rows if r["phase"] == phase]
        if not rs:
            continue
        secs = sum(r["seconds"] for r in rs)
        flops = sum(r["flops"] for r in rs)
        out[phase] = dict(calls=len(rs), seconds=secs, tokens_per_s=sum(r["counted_tokens"] for r in rs) / secs,
                          tflops=flops / secs / 1e12, peak_mib=max(r["peak_mib"] for r in rs),
                          mfu=(flops / secs / (peak_tflops * 1e12)) if peak_tflops else None)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3_100m",
                    help="a conf/model/ name: tiny | qwen3_100m | qwen3_1_7b | qwen3_8b")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--peak-tflops", type=float, default=None, help="the device's peak TFLOP/s for MFU")
    ap.add_argument("--out", default=".bench/gpu_smoke.json")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides (after --)")
    a = ap.parse_args(argv)
    import torch
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict

    from fspo.runtime.launch.memory_plan import model_shape
    from fspo.train import train

    cuda = torch.cuda.is_available()
    peak = a.peak_tflops
    device = torch.cuda.get_device_name() if cuda else "cpu"
    if peak is None and cuda:
        peak = next((v for k, v in PEAK_TFLOPS.items() if k in device), None)
    gpu = ["trainer.accelerator=gpu", "ppo.autocast=bf16"] if cuda else ["trainer.accelerator=cpu"]
    over = [f"+model={a.model}", f"steps={a.steps}", "val.size=0", "logger=csv", "ppo.old_log_probs=recompute",
            "checkpoint.every_n_steps=0", "progress.mode=off", *gpu, *a.overrides]
    with tempfile.TemporaryDirectory() as tmp:
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3", job_name="gpu_smoke"):
            cfg = compose(config_name="config", overrides=over)
        with open_dict(cfg):
            cfg.output_dir = str(Path(tmp) / "out")
        meter = Meter(model_shape(cfg.model), cuda)
        instrument(meter)
        try:
            train(cfg, overrides=over)  # as on the command line: placement and auto-fit keep these settings
        finally:  # a run stopped early (a signal, a time limit) still reports the calls it finished
            res = report(a, device, peak, meter)
    return res


def report(a, device: str, peak, meter: Meter) -> dict:
    """Print the per-phase table and write every call to ``a.out`` as JSON."""
    res = {"device": device, "model": a.model, "steps": a.steps, "peak_tflops": peak,
           "phases": summarize(meter.rows, peak), "calls": meter.rows}
    print(f"gpu_smoke: {a.model} on {device}, {a.steps} RL steps; MFU against "
          f"{f'{peak:g} TFLOP/s' if peak else 'n/a (give --peak-tflops)'}")
    print(f"{'phase':<14} {'calls':>5} {'seconds':>9} {'tokens/s':>10} {'TFLOP/s':>9} {'MFU':>7} {'peak MiB':>10}")
    for ph, r in res["phases"].items():
        mfu = f"{100 * r['mfu']:.2f}%" if r["mfu"] is not None else "n/a"
        print(f"{ph:<14} {r['calls']:>5} {r['seconds']:>9.2f} {r['tokens_per_s']:>10.1f} {r['tflops']:>9.4f} "
              f"{mfu:>7} {r['peak_mib']:>10.0f}")
    print("(generate: response tokens/s; old log-probs and update: prompt + response tokens/s; peak: "
          f"{'CUDA max_memory_allocated' if meter.cuda else 'RSS high-water mark'} per phase)")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
