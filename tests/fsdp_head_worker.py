"""Scenarios for tests/test_fsdp_lm_head.py: the chunked LM head (``ppo.lm_head_chunk_rows``) under FSDP2.

Run as ``torchrun --nproc_per_node=N tests/fsdp_head_worker.py OUT SCENARIOS [cpu|cuda] [auto|bf16|none]``
(scenarios comma-separated; the last argument is the sharding's mixed precision); each scenario writes
its results to OUT on rank 0.

- ``head``: for a tiny Qwen3 with tied and with untied embeddings, sharded by
  `fspo.runtime.launch.distributed.shard_model` (``fully_shard`` per decoder layer, then the root), and each of
  the three layouts (padded, one-row segment attention, packed rows), every rank computes
  `response_log_probs` of its half of `fsdp_worker.fixed_rollout` with the dense head and with the
  chunked one (chunks of 5 positions), then backward of ``sum(w * logp)`` (`loss_weights`); saved: all ranks' log-probs
  and entropies, the no-grad log-probs (the old-log-prob pass) and the full (summed over ranks)
  gradient of every parameter.
- ``head_bf16``: ``head`` with FSDP2's bf16 mixed precision (bf16 compute, fp32 master weights and
  gradient reduction), as trainer=fsdp runs on CUDA; on CPU too.
- ``step``: one RL step of the real `RLModule` (`fsdp_worker.run_step`) with trainer=fsdp and
  ``ppo.lm_head_chunk_rows=5``.

Leaves out: the assertions and the one-process references (tests/test_fsdp_lm_head.py).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import fsdp_worker  # noqa: E402
import torch

from fspo.models.segment_attention import enable_segment_attention  # noqa: E402
from fspo.models.tiny import tiny_qwen3_config  # noqa: E402
from fspo.update.logprobs import response_log_probs  # noqa: E402

LAYOUTS = {"padded": None, "segment": 0, "rows": 16}  # pack_width of `response_log_probs`
CHUNK = 5
TEMPERATURE = 0.7


def build_model(tied: bool):
    """The tiny Qwen3 (seed 0, initializer range 0.1 so the log-probs are far from uniform)."""
    from transformers import Qwen3ForCausalLM

    cfg = tiny_qwen3_config(initializer_range=0.1)
    cfg.tie_word_embeddings = tied
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return Qwen3ForCausalLM(cfg)


def loss_weights(batch, rows: torch.Tensor) -> torch.Tensor:
    """[B, T]: distinct weights per token of the full rollout's rows ``rows`` (``batch`` holds those rows,
    trimmed to its own response width), so every position's gradient is checked and the ranks' losses
    sum to the one-process loss."""
    full = fsdp_worker.fixed_rollout().response_ids.shape
    w = torch.linspace(-1.0, 1.5, full[0] * full[1]).reshape(full)
    return w[rows, :batch.response_ids.shape[1]]


def log_probs_and_grads(model, batch, layout: str, chunk: int, device, rows: torch.Tensor) -> dict:
    """logp, entropy (with grad), no-grad logp and the gradient of sum(w * logp) of ``model`` (already
    sharded or not); gradients as full tensors (DTensor gradients are gathered)."""
    if layout == "segment":
        enable_segment_attention(model)
    batch = batch.to(device) if hasattr(batch, "to") else batch
    kw = dict(temperature=TEMPERATURE, pack_width=LAYOUTS[layout], head_chunk_rows=chunk)
    with torch.no_grad():
        old, _ = response_log_probs(model, batch, **kw)
    lp, ent = response_log_probs(model, batch, with_entropy=True, **kw)
    (lp * loss_weights(batch, rows).to(lp.device)).sum().backward()
    grads = {}
    for n, p in model.named_parameters():
        g = p.grad
        if g is not None:
            grads[n] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().float().cpu()
    return {"logp": lp.detach().cpu(), "ent": ent.cpu(), "old": old.cpu(), "grads": grads}


def run_head(out: Path, device_type: str, mixed_precision: str = "auto") -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fspo.runtime.launch.distributed import ShardingConfig, shard_model

    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(device_type, int(os.environ.get("LOCAL_RANK", 0))) if device_type == "cuda" \
        else torch.device("cpu")
    mesh = init_device_mesh(device_type, (world,))
    full = fsdp_worker.fixed_rollout()
    rows = torch.arange(full.batch_size).tensor_split(world)[rank]
    part = full.select(rows).trim()
    results = {}
    for tied in (True, False):
        for layout in LAYOUTS:
            for chunk in (0, CHUNK):
                model = build_model(tied).to(device)
                shard_model(model, mesh, ShardingConfig(mixed_precision=None if mixed_precision == "none"
                                                        else mixed_precision))  # auto: bf16 compute on CUDA
                res = log_probs_and_grads(model, part, layout, chunk, device, rows)
                every = [None] * world
                dist.all_gather_object(every, {k: res[k] for k in ("logp", "ent", "old")})
                res.update({k: [e[k] for e in every] for k in ("logp", "ent", "old")})
                res["sharded"] = all(hasattr(p, "full_tensor") for p in model.parameters())
                results[(tied, layout, chunk)] = res
    if rank == 0:
        torch.save(results, out / f"head_w{world}_{device_type}_{mixed_precision}.pt")


if __name__ == "__main__":
    import torch.distributed as dist

    torch.set_num_threads(1)
    out_dir, names = Path(sys.argv[1]), sys.argv[2].split(",")
    dev = sys.argv[3] if len(sys.argv) > 3 else "cpu"
    mp = sys.argv[4] if len(sys.argv) > 4 else "auto"  # ShardingConfig.mixed_precision ("none": None)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if "step" in names:  # first: Lightning sets up the process group
        fsdp_worker.run_step(world_size, out_dir, [f"ppo.lm_head_chunk_rows={CHUNK}"], "_chunk")
    if {"head", "head_bf16"} & set(names):
        if dev == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        if not dist.is_initialized():
            dist.init_process_group("nccl" if dev == "cuda" else "gloo")
    if "head" in names:
        run_head(out_dir, dev, mp)
    if "head_bf16" in names:  # FSDP2 bf16 compute with fp32 master weights (what trainer=fsdp does on CUDA)
        run_head(out_dir, dev, "bf16")
    if dist.is_initialized():  # as tests/fsdp_worker.py: leave without the interpreter's gloo teardown
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
