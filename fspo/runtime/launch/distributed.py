"""Data-parallel sharding (FSDP2 through Lightning) and the rank arithmetic of a distributed RL step.

W ranks each holding 1/W of the data compute exactly what one process computes on all of it: every rank
gathers the whole rollout (`gather_rollout`), so PPO mini-batches are drawn from the global batch with the
same permutation; denominators (tokens, sequences) come from the global mini-batch and FSDP SUMS gradients
across ranks (``set_gradient_divide_factor(1.0)``), so the summed per-rank gradients equal the one-process one.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import List, Optional, Sequence

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import Tensor, nn

from fspo.types import RolloutBatch

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


@dataclass
class ShardingConfig:
    """How `shard_model` wraps the policy: ``layer_class`` is one FSDP unit each (None: the model's
    ``_no_split_modules``); ``mixed_precision`` "auto" is bf16 compute + fp32 reduction on CUDA, fp32
    elsewhere; ``cpu_offload`` is a no-op on CPU; ``reshard_after_forward=False`` trades memory for one
    all-gather per layer less in backward."""

    layer_class: Optional[str] = None
    mixed_precision: Optional[str] = "auto"
    activation_checkpointing: bool = False
    cpu_offload: bool = False
    reshard_after_forward: bool = True


class FSDP2Strategy(ModelParallelStrategy):
    """`ModelParallelStrategy` with every rank data-parallel; ``sharding``: the `ShardingConfig` fields, which
    `configure_sharding` reads."""

    def __init__(self, save_distributed_checkpoint: bool = True, process_group_backend: Optional[str] = None,
                 timeout_minutes: float = 30.0, **sharding):
        from datetime import timedelta

        super().__init__(data_parallel_size="auto", tensor_parallel_size=1,
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timedelta(minutes=timeout_minutes))
        self.sharding = ShardingConfig(**sharding)
        if self.sharding.mixed_precision not in (None, "auto", *_DTYPES):
            raise ValueError(f"trainer.strategy.mixed_precision must be auto, bf16, fp16 or null, "
                             f"got {self.sharding.mixed_precision!r}")

    def setup_environment(self) -> None:
        """Set data_parallel_size = world size (nodes x devices) before the mesh is built."""
        self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()


def find_layers(model: nn.Module, class_name: Optional[str]) -> List[nn.Module]:
    """Every submodule whose class is named ``class_name`` (default: ``model._no_split_modules``)."""
    names = {class_name} if class_name else set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        found = sorted({type(m).__name__ for m in model.modules() if "Layer" in type(m).__name__})
        raise ValueError(f"model.layer_class={class_name!r} matches no submodule of {type(model).__name__}; "
                         f"set model.layer_class to one of {found}")
    return layers


def shard_model(model: nn.Module, mesh, cfg: ShardingConfig) -> nn.Module:
    """``fully_shard`` each decoder layer, then ``model``; gradients summed across ``mesh``. Idempotent."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if isinstance(model, FSDPModule):
        return model
    layers = find_layers(model, cfg.layer_class)
    mp = cfg.mixed_precision
    if mp == "auto":
        mp = "bf16" if mesh.device_type == "cuda" else None
    policy = MixedPrecisionPolicy(param_dtype=_DTYPES[mp], reduce_dtype=torch.float32) if mp else MixedPrecisionPolicy()
    if cfg.activation_checkpointing:
        if not getattr(model, "supports_gradient_checkpointing", False):
            raise ValueError(f"{type(model).__name__} does not support activation checkpointing")
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    offload = cfg.cpu_offload and mesh.device_type != "cpu"  # on a CPU mesh everything is in CPU memory already
    kw = dict(mesh=mesh, mp_policy=policy, offload_policy=CPUOffloadPolicy() if offload else OffloadPolicy())
    for layer in layers:
        fully_shard(layer, reshard_after_forward=cfg.reshard_after_forward, **kw)
    fully_shard(model, reshard_after_forward=cfg.reshard_after_forward, **kw)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)  # sum, not mean (module docstring)
            m.set_force_sum_reduction_for_comms(True)  # plain SUM collectives (gloo has no PREMUL_SUM)
    return model


def configure_sharding(module) -> None:
    """`RLModule.configure_model` body: shard ``module.policy`` under a `ModelParallelStrategy`."""
    from fspo.models.meta_init import is_on_meta, load_local_shards

    trainer = attached_trainer(module)
    if trainer is None or not isinstance(trainer.strategy, ModelParallelStrategy):
        if is_on_meta(module.policy):  # built for sharded loading, run unsharded: load it whole
            load_local_shards(module.policy, module.device)
        return
    mesh = module.device_mesh
    if mesh["tensor_parallel"].size() != 1:
        raise NotImplementedError("tensor parallelism of the policy is not implemented: use trainer=fsdp")
    cfg = getattr(trainer.strategy, "sharding", None) or ShardingConfig()
    meta = is_on_meta(module.policy)
    shard_model(module.policy, mesh["data_parallel"], cfg)
    if meta:  # each rank materialises its shards and reads its rows of the checkpoint
        load_local_shards(module.policy, trainer.strategy.root_device)


def is_sharded(model: nn.Module) -> bool:
    """True when any parameter of ``model`` is a DTensor (FSDP2 / tensor parallel)."""
    return any(hasattr(p, "full_tensor") for p in model.parameters())


def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def attached_trainer(module):
    """The Trainer ``module`` is attached to; None when it has none (Lightning's ``.trainer`` raises there)."""
    try:
        return getattr(module, "trainer", None)
    except RuntimeError:
        return None


def dp_rank_size(module=None) -> tuple[int, int]:
    """(data-parallel rank, size) of ``module``'s mesh, else of the world; (0, 1) without distribution."""
    mesh = getattr(module, "device_mesh", None)  # LightningModule's, set by ModelParallelStrategy
    if mesh is not None:
        dp = mesh["data_parallel"]
        return dp.get_local_rank(), dp.size()
    if not _active():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def rank_slice(n: int, rank: int, size: int, what: str = "prompts_per_step") -> slice:
    """Rows ``[rank*n/size, (rank+1)*n/size)``; ``n`` must divide evenly (equal work per rank)."""
    if n % size:
        raise ValueError(f"{what}={n} is not divisible by the {size} data-parallel ranks: make it a multiple")
    k = n // size
    return slice(rank * k, (rank + 1) * k)


def pad_slice(items: Sequence, rank: int, size: int) -> tuple[list, int]:
    """(this rank's contiguous part of ``items`` padded to a multiple of ``size`` by repeating the last
    item, how many of the returned items are real): equal counts keep FSDP generation in lockstep."""
    items = list(items)
    k = -(-len(items) // size) if items else 0
    padded = items + items[-1:] * (k * size - len(items))
    return padded[rank * k:(rank + 1) * k], max(0, min(len(items), (rank + 1) * k) - rank * k)


def reduce_sum(values: Sequence[float], device=None) -> List[float]:
    """Element-wise sum of ``values`` over all ranks (float64; identity without distribution)."""
    if not _active():
        return [float(v) for v in values]
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def rank_offset(n: int, rank: int, size: int, device=None) -> int:
    """Where this rank's ``n`` rows start in the rank-order concatenation (`gather_rollout`)."""
    if size == 1:
        return 0
    sizes = reduce_sum([n if r == rank else 0 for r in range(size)], device)
    return int(sum(sizes[:rank]))


def sync_count(n: int, device=None) -> int:
    """max over ranks of ``n`` (e.g. micro-batches this rank runs)."""
    if not _active():
        return n
    t = torch.tensor([n], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def max_over_ranks(values: Tensor) -> List[float]:
    """Element-wise max of ``values`` [n] over all ranks, read to the host once (one device sync)."""
    if _active():
        values = values.clone()
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return values.tolist()


def any_rank(flag: bool, device=None) -> bool:
    """True when ``flag`` is True on any rank (so every rank takes the same branch)."""
    return sync_count(int(bool(flag)), device) > 0


def reduce_step_stats(stats, device=None) -> None:
    """Sum a `StepStats`'s token/loss accumulators over ranks, in place (grad norms are already global)."""
    stats.flush()  # the sums kept on the device first
    keys = ("loss_sum", "tokens", "kl_sum", "ent_sum", "ent_tokens", "gap_sum", "gap_tokens")
    usages = (stats.usage, stats.usage_old)
    vals = reduce_sum([getattr(stats, k) for k in keys] + [x for u in usages for x in (u.slots, u.tokens)], device)
    for k, v in zip(keys, vals):
        setattr(stats, k, v)
    for i, u in enumerate(usages):
        u.slots, u.tokens = vals[len(keys) + 2 * i], vals[len(keys) + 2 * i + 1]


def _pad(t: Tensor, width: int, left: bool) -> Tensor:
    extra = width - t.shape[1]
    return torch.nn.functional.pad(t, (extra, 0) if left else (0, extra)) if extra else t


def _offset_groups(parts: List[Tensor]) -> List[Tensor]:
    """Each rank's group ids shifted past the previous ranks' (rank order), so they stay unique."""
    offset, groups = 0, []
    for g in parts:
        groups.append(g + offset)
        offset += int(g.max()) + 1 if g.numel() else 0
    return groups


def gather_objects(obj) -> list:
    """``obj`` of every rank, in rank order (``[obj]`` on one rank)."""
    if not _active():
        return [obj]
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, obj)
    return parts


def gather_group_ids(group_ids: Tensor) -> Tensor:
    """The group ids `gather_rollout` will give the global batch; identity on one rank."""
    if not _active():
        return group_ids
    return torch.cat(_offset_groups(gather_objects(group_ids.cpu()))).to(group_ids.device)


def concat_rollouts(parts: List[RolloutBatch], offset_groups: bool = True) -> RolloutBatch:
    """``parts`` concatenated in order (prompts left-padded, responses right-padded, group ids kept
    unique when ``offset_groups``); a field missing from any part is None."""
    p = max(b.prompt_ids.shape[1] for b in parts)
    t = max(b.response_ids.shape[1] for b in parts)
    groups = _offset_groups([b.group_ids for b in parts]) if offset_groups else None
    kw = {}
    for f in fields(RolloutBatch):
        vals = [getattr(b, f.name) for b in parts]
        if f.name == "group_ids" and groups is not None and all(v is not None for v in vals):
            vals = groups
        if any(v is None for v in vals):
            kw[f.name] = None
        elif vals[0].dim() == 2:
            left = f.name.startswith("prompt")
            kw[f.name] = torch.cat([_pad(v, p if left else t, left) for v in vals])
        else:
            kw[f.name] = torch.cat(vals)
    return RolloutBatch(**kw)


def gather_rollout(batch: RolloutBatch) -> RolloutBatch:
    """Concatenate every rank's rollout batch in rank order (`concat_rollouts`); identity on one rank."""
    if not _active():
        return batch
    return concat_rollouts(gather_objects(batch.to("cpu"))).to(batch.response_ids.device)


def clip_grad_norm(parameters, max_norm: float) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` returning the global norm as a plain tensor (DTensor-safe)."""
    norm = torch.nn.utils.clip_grad_norm_(list(parameters), max_norm)
    full = getattr(norm, "full_tensor", None)
    return full() if full is not None else norm
