"""Scenarios for tests/test_fsdp_overlap.py: pipelined rollouts (``rollout.overlap``) under FSDP2 on
2 gloo ranks, run by ``torchrun --nproc_per_node=2 tests/fsdp_overlap_worker.py OUT SCENARIOS``.

Owns: `run_push` (each rank's engine process receives the full weights gathered from the shards, at
start and after an update, and generates with them what an unsharded copy generates) and `run_e2e`
(`fspo.train.train` with ``trainer=fsdp rollout.overlap.enable=true``: MLflow, 3 steps). Each rank
writes its results to OUT. Leaves out: the assertions (tests/test_fsdp_overlap.py).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from conftest import compose_config  # noqa: E402
from fspo.models.tiny import build_tiny_model, build_tokenizer  # noqa: E402
from fspo.rollout.async_engine import AsyncEngine  # noqa: E402
from fspo.rollout.base import SamplingConfig  # noqa: E402
from fspo.rollout.hf import HFEngine  # noqa: E402

PROMPTS = [["Q:2+7+4-5\nA:", "Q:1+1\nA:"], ["Q:9-3+8-1+6\nA:", "Q:5+5-2+7\nA:"]]  # rank 0 | rank 1
GREEDY = SamplingConfig(n=1, temperature=0.0, max_new_tokens=12, seed=0)


def _close(slot, ref) -> float:
    """Largest |slot - ref| over every tensor of the reference state dict (inf when a name is missing)."""
    worst = 0.0
    for k, v in ref.state_dict().items():
        if k not in slot:
            return float("inf")
        worst = max(worst, float((slot[k] - v).abs().max()))
    return worst


def run_push(out: Path) -> None:
    """Start an engine process on the sharded tiny policy, move the shards, push, generate greedily."""
    from torch.distributed.device_mesh import init_device_mesh

    from fspo.runtime.launch.distributed import ShardingConfig, shard_model

    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    tok = build_tokenizer()
    policy, ref = build_tiny_model(seed=0), build_tiny_model(seed=0)
    shard_model(policy, init_device_mesh("cpu", (world,)), ShardingConfig())
    local = {n: tuple(p.to_local().shape) for n, p in policy.named_parameters()}
    engine = AsyncEngine(HFEngine(), slots=1, threads=1)
    engine.start(policy, tok)  # collective: both ranks
    res = {"sharded": any(hasattr(p, "full_tensor") for p in policy.parameters()), "local_shapes": local,
           "start_err": _close(engine.slots[0], ref)}
    with torch.no_grad():  # an "update": every shard moves, the reference in the same way
        for (_n, p), q in zip(policy.named_parameters(), ref.parameters()):
            p.mul_(1.01).add_(0.003)
            q.mul_(1.01).add_(0.003)
    engine.push(policy, 0)  # collective
    res["push_err"] = _close(engine.slots[0], ref)
    ids = [tok.encode(p) for p in PROMPTS[rank]]
    engine.submit(0, ids, GREEDY)
    got = engine.result()
    want = HFEngine()
    want.setup(ref.eval(), tok, "")
    exp = want.generate(ids, GREEDY)
    res["tokens_equal"] = torch.equal(got.response_ids, exp.response_ids) and torch.equal(got.response_mask,
                                                                                          exp.response_mask)
    res["logprob_err"] = float((got.engine_log_probs - exp.engine_log_probs).abs().max())
    res["n_tokens"] = int(got.response_mask.sum())
    engine.close()
    torch.save(res, out / f"push_rank{rank}.pt")


def run_e2e(out: Path) -> None:
    """3 RL steps of `fspo.train.train` with FSDP and pipelined rollouts (MLflow in out/mlflow.db)."""
    from fspo.train import train

    cfg = compose_config(["model.source=warmstart", "trainer=fsdp", "steps=3", "prompts_per_step=8",
                          "rollout.sampling.n=4", "ppo.mini_batch_size=8", "ppo.mini_batch_unit=sequences",
                          "rollout.sampling.max_new_tokens=40",
                          "ppo.lr=5e-4", "val.size=0", "rollout.overlap.enable=true"],
                         output_dir=out / "e2e", tracking_uri=f"sqlite:///{out / 'mlflow.db'}",
                         artifact_location=out / "artifacts")
    train(cfg)


if __name__ == "__main__":
    torch.set_num_threads(1)
    out_dir = Path(sys.argv[1])
    for name in sys.argv[2].split(","):
        {"push": lambda: run_push(out_dir), "e2e": lambda: run_e2e(out_dir)}[name]()
    if torch.distributed.is_initialized():  # as tests/fsdp_worker.py: leave without gloo's teardown
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
