"""Scenarios for tests/test_guard.py's two-rank test, run by ``torchrun --nproc_per_node=2
tests/guard_worker.py OUT`` (or `run_guarded_step` in-process on one rank).

Owns: the verdicts of `DivergenceGuard.check` on 2 gloo ranks when only rank 1 sees a breach, when only
the all-reduced sums exceed the limit, and when nothing does (``OUT/verdicts_<rank>.json``); and
`run_guarded_step`: one RL step of the real `RLModule` under FSDP (tests/fsdp_worker.py's fixed
rollout, 2 updates) whose second update is reported past a limit by rank 1 only, with
``guard.action=skip`` (``OUT/step_w<world>.pt``: parameters, skipped updates, trips). Leaves out:
the assertions (tests/test_guard.py).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from fsdp_worker import OVERRIDES, InjectShare, _data, _full_params, _trainer, build_module, fixed_rollout  # noqa: E402

from conftest import compose_config  # noqa: E402
from fspo.update.guard import DivergenceGuard, UpdateMeter  # noqa: E402


class BreachOnRank(DivergenceGuard):
    """Reports a breach at its ``at``-th check, seen by rank ``rank`` only (the other ranks see none)."""

    def __init__(self, rank: int, at: int = 2):
        super().__init__(action="skip")
        self.rank, self.at, self.calls = rank, at, 0

    def breaches(self, grad_norm, loss, kl):
        self.calls += 1
        here = dist.get_rank() if dist.is_initialized() else 0
        return ["forced breach"] if self.calls == self.at and here == self.rank else []


def verdicts(out: Path) -> None:
    rank = dist.get_rank()
    m = UpdateMeter()
    m.loss_sum, m.tokens = 8.0, 10.0 if rank == 0 else 0.0  # 0.8 per token on rank 0; 1.6 all-reduced
    res = {"rank1_only": BreachOnRank(rank=1, at=1).check(torch.tensor(1.0), UpdateMeter()),
           "global_only": DivergenceGuard(action="skip", max_loss=1.0).check(torch.tensor(1.0), m),
           "none": DivergenceGuard(action="skip").check(torch.tensor(1.0), UpdateMeter())}
    (out / f"verdicts_{rank}.json").write_text(json.dumps(res))


def run_guarded_step(world: int, out: Path) -> dict:
    """One RL step on `fixed_rollout` with the second update reported past a limit by rank 1 only
    (rank 0 on one process) and ``guard.action=skip``."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = compose_config(OVERRIDES + ["trainer=fsdp"], output_dir=out)
    module = build_module(cfg)
    module.guard = BreachOnRank(rank=1 if world > 1 else 0)
    trainer = _trainer(cfg, world, out / f"guard{world}", [InjectShare(fixed_rollout())])
    trainer.fit(module, datamodule=_data(cfg, 1))
    res = {"params": _full_params(module), "skipped": int(module.skipped_updates),
           "trips": float(trainer.callback_metrics["guard/trips"])}
    if trainer.global_rank == 0:
        torch.save(res, out / f"step_w{world}.pt")
    return res


if __name__ == "__main__":
    torch.set_num_threads(1)
    out_dir = Path(sys.argv[1])
    run_guarded_step(int(os.environ["WORLD_SIZE"]), out_dir)  # Lightning starts the process group
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    verdicts(out_dir)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as fsdp_worker: skip the interpreter teardown with a live gloo thread
