"""Scenarios for tests/test_fsdp.py, run by ``torchrun --nproc_per_node=2 tests/fsdp_worker.py OUT``
(or in-process on one rank through `run_step`). Each scenario writes its results to OUT on rank 0.

Owns: `fixed_rollout` (a hand-built 16-row rollout, 4 prompts x 4 samples), `run_step` (one RL step
of the real `RLModule` on that rollout: each rank is injected its contiguous share of the groups,
exactly as `RolloutCallback` splits prompts), `run_resume` (3 RL steps with HF generation through
`RolloutCallback`, uninterrupted versus stopped after step 2 with a sharded checkpoint and resumed)
and `run_e2e` (`fspo.train.train` with ``trainer=fsdp``: Hydra config, generation, validation,
MLflow). Leaves out: the assertions (tests/test_fsdp.py).
"""
from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
from hydra.utils import instantiate

from conftest import compose_config  # noqa: E402
from fspo.data.datamodule import PromptDataModule  # noqa: E402
from fspo.models.tiny import build_tiny_model, build_tokenizer  # noqa: E402
from fspo.rollout.callback import RolloutCallback  # noqa: E402
from fspo.rollout.weights import iter_full_state_dict  # noqa: E402
from fspo.runtime.launch.distributed import dp_rank_size, rank_slice, reduce_sum  # noqa: E402
from fspo.train import build_fairness  # noqa: E402
from fspo.types import RolloutBatch  # noqa: E402

# padded micro-batches (ppo.packing=false): packed rows depend on each rank's share of the batch, so
# per-token log-probs then differ from one process at float noise (<= 1e-6 measured), which the first
# AdamW step at lr 1e-3 amplifies to ~3e-5 in the parameters; packing is pinned in test_packing.py.
# small micro-batches (uneven counts across ranks -> dummy micro-batches: with budget 32 the first
# mini-batch's token-balanced shares, 45 tokens each, take 3 and 2 padded micro-batches, since padding
# counts rows x longest row), 2 updates per step,
# FSPO with the EMA band (its observe() all-reduces), a clip-fraction bin width that fits 12 tokens
OVERRIDES = ["ppo.packing=false", "model.source=random", "data.train.size=64", "clip=fspo_ema", "ppo.mini_batch_size=8",
             "ppo.mini_batch_unit=sequences", "ppo.micro_batch_max_tokens=32",
             "ppo.lr=1e-3", "data.length_bin_width=4", "rollout.sampling.max_new_tokens=12"]
G, PROMPTS = 4, 4
# activation checkpointing (the sharding option that changes the computation on CPU)
AC = ["trainer.strategy.activation_checkpointing=true"]


def fixed_rollout() -> RolloutBatch:
    """16 rows (groups of 4), prompts 3..9 and responses 1..12 tokens, off-policy old log-probs."""
    g = torch.Generator().manual_seed(0)
    b = G * PROMPTS
    p_len, r_len = torch.randint(3, 10, (b,), generator=g), torch.randint(1, 13, (b,), generator=g)
    P, T = int(p_len.max()), int(r_len.max())
    batch = RolloutBatch(prompt_ids=torch.zeros(b, P, dtype=torch.long),
                         prompt_mask=torch.zeros(b, P, dtype=torch.long),
                         response_ids=torch.zeros(b, T, dtype=torch.long),
                         response_mask=torch.zeros(b, T, dtype=torch.long),
                         group_ids=torch.arange(b) // G, advantages=torch.randn(b, generator=g),
                         rewards=torch.zeros(b), overlong=r_len == 12)
    for i in range(b):
        batch.prompt_ids[i, P - p_len[i]:] = torch.randint(4, 100, (int(p_len[i]),), generator=g)
        batch.prompt_mask[i, P - p_len[i]:] = 1
        batch.response_ids[i, :r_len[i]] = torch.randint(4, 100, (int(r_len[i]),), generator=g)
        batch.response_mask[i, :r_len[i]] = 1
    with torch.no_grad():
        lp, _ = __import__("fspo.update.logprobs", fromlist=["x"]).response_log_probs(build_tiny_model(seed=0), batch)
    batch.old_log_probs = ((lp + 0.05 * torch.randn(b, T, generator=g)) * batch.response_mask).float()
    return batch.validate()


class InjectShare(L.Callback):
    """Puts this rank's contiguous share of whole groups of ``rollout`` into each training batch."""

    def __init__(self, rollout: RolloutBatch):
        self.rollout = rollout

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        rank, world = dp_rank_size(pl_module)
        groups = rank_slice(PROMPTS, rank, world)
        rows = torch.arange(groups.start * G, groups.stop * G)
        part = copy.deepcopy(self.rollout.select(rows))
        part.group_ids = part.group_ids - groups.start
        batch["rollout"] = part
        batch["rollout_metrics"] = {}


def build_module(cfg):
    """RLModule from a composed config, as fspo/train.py builds it (random tiny policy, seed 0)."""
    from fspo.update.module import RLModule

    L.seed_everything(int(cfg.seed))
    policy = build_tiny_model(seed=0)
    return RLModule(policy=policy, clip=instantiate(cfg.clip), aggregator=instantiate(cfg.aggregator),
                    ppo=instantiate(cfg.ppo), diagnostics=build_fairness(cfg, 0),
                    run_diagnostics=build_fairness(cfg, 0), seed=int(cfg.seed))


def _trainer(cfg, world: int, root: Path, callbacks, **kw) -> L.Trainer:
    strategy = instantiate(cfg.trainer.strategy) if world > 1 else "auto"
    kw.setdefault("enable_checkpointing", False)
    return L.Trainer(accelerator="cpu", devices=world, strategy=strategy, logger=False, max_epochs=1,
                     enable_progress_bar=False, enable_model_summary=False,
                     use_distributed_sampler=False, num_sanity_val_steps=0, limit_val_batches=0,
                     default_root_dir=str(root), callbacks=callbacks, **kw)


def _full_params(module) -> dict:
    return {k: v.detach().cpu().clone() for k, v in iter_full_state_dict(module.policy, include_tied_lm_head=False)}


def _data(cfg, steps: int) -> PromptDataModule:
    return PromptDataModule(instantiate(cfg.data.train), None, prompts_per_step=PROMPTS, steps=steps, seed=0)


def _stream_check(module) -> dict:
    """How `iter_full_state_dict` gathers: the count of DTensor.full_tensor calls seen at each yield
    (1, 2, 3, ...: one gather per tensor, made only when the consumer asks) and the fraction of the
    parameters this rank holds."""
    from torch.distributed.tensor import DTensor

    calls, seen, orig = [0], [], DTensor.full_tensor

    def counting(self, *a, **k):
        calls[0] += 1
        return orig(self, *a, **k)

    DTensor.full_tensor = counting
    try:
        for _ in iter_full_state_dict(module.policy, include_tied_lm_head=False):
            seen.append(calls[0])
    finally:
        DTensor.full_tensor = orig
    params = list(module.policy.parameters())
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in params)
    return {"gathers_at_yield": seen, "local_fraction": local / sum(p.numel() for p in params)}


def run_step(world: int, out: Path, extra=(), tag: str = "") -> dict:
    """One RL step on `fixed_rollout`; returns {"metrics", "params", ...} (saved to out/step_w{world}{tag}.pt)."""
    cfg = compose_config(OVERRIDES + ["trainer=fsdp", *extra], output_dir=out)
    module = build_module(cfg)
    from fspo.update import forward as passes

    dummies, plain, grads, adam_step = [0], passes.micro_batches, [], torch.optim.AdamW.step

    def counted(mod, batch):  # how many zero-weight dummy micro-batches kept the ranks in lockstep
        groups, width = plain(mod, batch)
        dummies[0] += sum(g is None for g in groups)
        return groups, width

    def recording(opt, *a, **k):  # the gradient each optimizer step applies (summed over the ranks)
        full = [getattr(q.grad, "full_tensor", lambda q=q: q.grad)() for g in opt.param_groups for q in g["params"]]
        grads.append([x.detach().cpu().clone() for x in full])
        return adam_step(opt, *a, **k)

    passes.micro_batches, torch.optim.AdamW.step = counted, recording
    try:
        trainer = _trainer(cfg, world, out / f"step{world}{tag}", [InjectShare(fixed_rollout())])
        trainer.fit(module, datamodule=_data(cfg, 1))
    finally:
        passes.micro_batches, torch.optim.AdamW.step = plain, adam_step
    res = {"metrics": {k: float(v) for k, v in trainer.callback_metrics.items()}, "params": _full_params(module),
           "dummies": reduce_sum([dummies[0]])[0], "grads": grads,
           "grad_ckpt": bool(getattr(module.policy, "is_gradient_checkpointing", False))}
    if world > 1:
        res.update(_stream_check(module))
    if trainer.global_rank == 0:
        torch.save(res, out / f"step_w{world}{tag}.pt")
    return res


def parity_reward(texts, refs, lengths, overlong, max_new_tokens):
    """Toy reward with variance for a random policy: 1 for an even number of characters, else 0."""
    from fspo.rewards.base import RewardOutput

    return RewardOutput(scores=[float(len(t) % 2 == 0) for t in texts])


def _rollout_callback(cfg, tok):
    return RolloutCallback(engine=instantiate(cfg.rollout.engine), tokenizer=tok, reward_fn=parity_reward,
                           advantage_fn=instantiate(cfg.advantage), sampling=instantiate(cfg.rollout.sampling),
                           val_sampling=instantiate(cfg.val.sampling), max_prompt_len=int(cfg.data.max_prompt_len),
                           seed=int(cfg.seed))


def run_resume(world: int, out: Path) -> None:
    """HF generation with `parity_reward`, 3 RL steps: uninterrupted (a ModelCheckpoint saves the
    sharded state after RL step 2 = optimizer step 4) versus a fresh module resumed from that
    checkpoint; saves both final parameter sets and the checkpoint's file list."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    cfg = compose_config([o for o in OVERRIDES if not o.startswith(("model.source", "rollout.sampling.max"))]
                         + ["trainer=fsdp", "model.source=random", "rollout.sampling.max_new_tokens=16"],
                         output_dir=out)
    tok = build_tokenizer()
    results = {}
    module = build_module(cfg)
    saver = ModelCheckpoint(dirpath=out / "ckpt", filename="rl2", every_n_train_steps=4, save_top_k=-1)
    trainer = _trainer(cfg, world, out / "full", [_rollout_callback(cfg, tok), saver], enable_checkpointing=True)
    trainer.fit(module, datamodule=_data(cfg, 3))
    results["full"], results["full_step"] = _full_params(module), int(module.rl_step)
    results["zero_adv_group_frac"] = float(trainer.callback_metrics["reward/zero_adv_group_frac"])
    ckpt = out / "ckpt" / "rl2.ckpt"
    results["ckpt_files"] = sorted(p.name for p in ckpt.iterdir()) if ckpt.is_dir() else []

    module = build_module(cfg)
    with torch.no_grad():  # scramble: everything must come from the checkpoint
        for p in module.policy.parameters():
            p.add_(0.01)
    trainer = _trainer(cfg, world, out / "resumed", [_rollout_callback(cfg, tok)])
    trainer.fit(module, datamodule=_data(cfg, 3), ckpt_path=str(ckpt))
    results["resumed"], results["resumed_step"] = _full_params(module), int(module.rl_step)
    if trainer.global_rank == 0:
        torch.save(results, out / f"resume_w{world}.pt")


DECODE_PROMPTS = [["Q:2+7+4-5\nA:", "Q:1+1\nA:"], ["Q:9-3+8-1+6\nA:", "Q:5+5-2+7-1+3-4\nA:"]]  # rank 0 | rank 1


def run_decode(world: int, out: Path) -> None:
    """Greedy `decode_compact(synced=True)` of the committed warm-start model sharded by FSDP2 over
    the ranks, each rank with its own prompts of `DECODE_PROMPTS` (answers of different lengths, so
    one rank runs out of rows first); saves every rank's tokens and engine log-probs."""
    from torch.distributed.device_mesh import init_device_mesh

    from fspo.models.loading import load_policy
    from fspo.rollout.base import SamplingConfig
    from fspo.rollout.decode import decode_compact
    from fspo.rollout.hf import left_pad
    from fspo.runtime.launch.distributed import ShardingConfig, shard_model

    if not torch.distributed.is_initialized():  # after the Lightning scenarios their group is still up
        torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank()
    model, tok = load_policy(source="warmstart")
    shard_model(model, init_device_mesh("cpu", (world,)), ShardingConfig())
    model.eval()
    ids, mask = left_pad([tok.encode(p) for p in DECODE_PROMPTS[rank]], tok.pad_token_id)
    dec = decode_compact(model, ids, mask, SamplingConfig(n=1, temperature=0.0, max_new_tokens=60),
                         tok.eos_token_id, tok.pad_token_id, synced=True)
    parts = [None] * world
    torch.distributed.all_gather_object(parts, (dec.tokens, dec.log_probs))
    if rank == 0:
        torch.save(parts, out / "decode_w2.pt")


def run_e2e(out: Path) -> None:
    """`fspo.train.train` with trainer=fsdp (generation, validation, MLflow); saves final metrics."""
    from fspo.train import train

    # the warm start (a local folder): under trainer=fsdp built on meta, each rank reading its shard
    cfg = compose_config(["model.source=warmstart", "trainer=fsdp", "steps=2", "prompts_per_step=4",
                          "rollout.sampling.n=4", "ppo.mini_batch_size=8", "ppo.mini_batch_unit=sequences",
                          "rollout.sampling.max_new_tokens=16",
                          "val.size=6", "val.batch_size=6", "val.every_n_steps=2"],
                         output_dir=out / "e2e", tracking_uri=f"sqlite:///{out / 'mlflow.db'}",
                         artifact_location=out / "artifacts")
    final = train(cfg)
    if int(os.environ.get("RANK", "0")) == 0:
        (out / "e2e.json").write_text(json.dumps(final, indent=1, sort_keys=True))


if __name__ == "__main__":
    torch.set_num_threads(1)
    out_dir = Path(sys.argv[1])
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    for name in (sys.argv[2].split(",") if len(sys.argv) > 2 else ["step", "resume", "e2e"]):
        {"step": lambda: run_step(world_size, out_dir),
         "step_ac": lambda: run_step(world_size, out_dir, AC, "_ac"),
         "resume": lambda: run_resume(world_size, out_dir), "e2e": lambda: run_e2e(out_dir),
         "decode": lambda: run_decode(world_size, out_dir)}[name]()
    # every rank past its last collective and file before gloo is torn down; then leave without the
    # interpreter's teardown, where a still-joinable gloo thread aborted the process now and then
    # ("terminate called without an active exception", exit -6)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
