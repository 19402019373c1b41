"""Peak memory per rank of one RL training step, 1 process versus 2 FSDP ranks (trainer=fsdp).

For each model (the tiny Qwen3, ~0.8M parameters, a random ~100M-parameter Qwen3, and the tiny one
with Qwen3's real 151,936-token vocabulary, where the logits dominate) and each
world size (1: one process, no strategy; 2: `fspo.runtime.launch.distributed.FSDP2Strategy` under torchrun) it runs
one RL step of the real `RLModule` (2 PPO mini-batches, AdamW) on a synthetic rollout of 16
sequences (prompt 32 + response 96 tokens) and reports per rank:

- ``load_peak_mib``: the RSS high-water mark after building the policy (every rank builds the full
  model before sharding, as fspo/train.py does);
- ``step_peak_mib``: on CPU the RSS high-water mark during the step, after resetting it
  (``/proc/self/clear_refs``; freed memory is returned to the OS first with ``malloc_trim``); on GPU
  ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``;
- ``step_delta_mib``: ``step_peak_mib`` minus the memory in use when the step started (what the
  step itself adds: gradients, AdamW state, activations, gathered layers);
- ``state_mib``: parameter + gradient + AdamW-state bytes this rank holds (local shard numel x 4 x 4).

    python benchmarks/bench_memory.py                 # prints a table, writes .bench/bench_memory.json
    python benchmarks/bench_memory.py --models tiny --worlds 1,2
    python benchmarks/bench_memory.py --models tiny_v152k --worlds 1 --lm-head-chunk 0,256   # dense vs chunked head

``--lm-head-chunk``: values of ``ppo.lm_head_chunk_rows`` to compare (0: the dense LM head; N > 0: the
chunked one, fspo/update/lm_head.py, N positions per chunk; with world 2 under FSDP too).
``--micro-batch-tokens``: values of ``ppo.micro_batch_max_tokens`` (the token budget of one forward/backward;
the sequences here are 56..128 tokens, 8 per mini-batch and rank on one process, 4 on each of 2).

    python benchmarks/bench_memory.py --models tiny_v152k --worlds 1 --micro-batch-tokens 256,1024,4096

Each (model, world) runs in fresh processes (torchrun for world > 1) so the peaks do not mix.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import MODELS, reset_peak_rss, rss_mib, synthetic_rollout, torchrun, write_json


def worker(model_name: str, out: str, head_chunk: int = 0, budget: int = 1024) -> None:
    """One RL step on this process's share of `synthetic_rollout` (run by `main`, under torchrun when world > 1)."""
    import lightning as L
    import torch

    from fspo.clipping.fspo import FSPOClip
    from fspo.diagnostics import FairnessMetrics, LengthBins
    from fspo.losses import Aggregator
    from fspo.models.tiny import build_tiny_model
    from fspo.runtime.launch.distributed import FSDP2Strategy, dp_rank_size
    from fspo.update.module import RLModule
    from fspo.update.settings import PPOConfig

    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    policy = build_tiny_model(seed=0, **MODELS[model_name])
    n_params = sum(p.numel() for p in policy.parameters())
    load_peak = rss_mib("VmHWM")
    diag = FairnessMetrics(LengthBins(width=16, max_len=96))
    ppo = PPOConfig(mini_batch_size=8, mini_batch_unit="sequences", lr=1e-5,
                    micro_batch_max_tokens=budget, lm_head_chunk_rows=head_chunk)
    module = RLModule(policy, FSPOClip(), Aggregator("token-mean"), ppo, diag, seed=0)
    full = synthetic_rollout()
    record = {}

    class Step(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            rank, size = dp_rank_size(pl_module)
            k = full.batch_size // size
            part = full.select(torch.arange(rank * k, (rank + 1) * k))
            part.group_ids = part.group_ids - part.group_ids.min()
            batch["rollout"] = part
            local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel()
                        for p in pl_module.policy.parameters())
            record["state_mib"] = local * 4 * 4 / 2**20
            reset_peak_rss(trim=True)
            record["step_base_mib"] = torch.cuda.memory_allocated() / 2**20 if torch.cuda.is_available() \
                else rss_mib("VmRSS")
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            cuda = torch.cuda.is_available()
            record["step_peak_mib"] = torch.cuda.max_memory_allocated() / 2**20 if cuda else rss_mib("VmHWM")
            record["peak_kind"] = "cuda max_memory_allocated" if cuda else "RSS high-water mark"
            record["step_delta_mib"] = record["step_peak_mib"] - record["step_base_mib"]

    strategy = FSDP2Strategy(layer_class="Qwen3DecoderLayer") if world > 1 else "auto"
    trainer = L.Trainer(accelerator="auto", devices=world, strategy=strategy, logger=False, max_epochs=1,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, limit_val_batches=0, callbacks=[Step()])
    from torch.utils.data import DataLoader

    trainer.fit(module, train_dataloaders=DataLoader([{"prompts": ["x"]}], batch_size=None))
    record.update(model=model_name, lm_head_chunk_rows=head_chunk, micro_batch_max_tokens=budget, params=n_params,
                  world=world, rank=trainer.global_rank, load_peak_mib=load_peak)
    Path(out).with_suffix(f".rank{trainer.global_rank}.json").write_text(json.dumps(record))


def main(argv=None) -> None:
    """Run every (model, world) in fresh processes, print a table, write the JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="tiny,qwen3_100m")
    ap.add_argument("--worlds", default="1,2")
    ap.add_argument("--lm-head-chunk", default="0", help="comma-separated ppo.lm_head_chunk_rows values (0: dense)")
    ap.add_argument("--micro-batch-tokens", default="1024", help="comma-separated ppo.micro_batch_max_tokens values")
    ap.add_argument("--out", default=".bench/bench_memory.json")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker-chunk", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--worker-budget", type=int, default=1024, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        return worker(a.worker, a.worker_out, a.worker_chunk, a.worker_budget)
    # glibc: serve every allocation >= 128 KiB by mmap, so freed tensors leave the RSS at once and the
    # high-water mark tracks live memory (else per-thread arenas keep freed chunks and inflate it)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="131072")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model, world, chunk, budget in ((m, int(w), int(c), int(t)) for m in a.models.split(",")
                                            for w in a.worlds.split(",") for c in a.lm_head_chunk.split(",")
                                            for t in a.micro_batch_tokens.split(",")):
            base = Path(tmp) / f"{model}_w{world}_c{chunk}_t{budget}"
            launch = [sys.executable] if world == 1 else torchrun(world)
            cmd = launch + [__file__, "--worker", model, "--worker-out", str(base), "--worker-chunk", str(chunk),
                            "--worker-budget", str(budget)]
            subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
            rows += [json.loads(base.with_suffix(f".rank{r}.json").read_text()) for r in range(world)]
    print(f"{'model':<11} {'head chunk':>10} {'mb tokens':>9} {'params':>10} {'world':>5} {'rank':>4} "
          f"{'load peak':>10} {'step peak':>10} {'step adds':>10} {'param+grad+Adam':>16}   (MiB)")
    for r in rows:
        print(f"{r['model']:<11} {r['lm_head_chunk_rows']:>10} {r['micro_batch_max_tokens']:>9} {r['params']:>10} "
              f"{r['world']:>5} {r['rank']:>4} {r['load_peak_mib']:>10.0f} {r['step_peak_mib']:>10.0f} "
              f"{r['step_delta_mib']:>10.0f} {r['state_mib']:>16.1f}")
    write_json(a.out, rows)
    print(f"peaks: {rows[0]['peak_kind'] if rows else ''}")


if __name__ == "__main__":
    main()
