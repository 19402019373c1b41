"""The memory plan of a run, per rank, from its config: logged at start-up, printed by ``dry_run=true``; a
layout that cannot fit is refused before the model loads, with the layout that would.

Device memory: on CUDA the total memory of the rank's own GPU (read without creating a context on GPU 0); on
CPU physical RAM / the ranks on the node; ``memory_plan.device_gib=N`` stands in for either.
"""
from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import Callable, Mapping, Optional, Tuple

from fspo.runtime.launch.memory_components import GIB, Layout, MemoryPlan, ModelShape, plan_memory  # noqa: F401
from fspo.runtime.launch.precision import engine_dtype

log = logging.getLogger(__name__)
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
FSDP = "fspo.runtime.launch.distributed.FSDP2Strategy"
MAX_RANKS = 256  # what_would_fit looks this far


class MemoryPlanError(ValueError):
    """The configured layout needs more memory per rank than is available."""


def model_shape(model_cfg) -> Optional[ModelShape]:
    """The model's shape from its config alone (no weights, no hub): the local config.json, else ``model.arch``
    (always for a random model); None when neither exists."""
    from fspo.models.loading import local_model_config

    arch = dict(model_cfg.get("arch") or {})
    try:
        return _shape(local_model_config(model_cfg).to_dict())
    except (OSError, ValueError):
        if model_cfg.get("source") == "random":  # a malformed model.arch: its own error
            raise
        return _shape(arch) if arch.get("num_hidden_layers") else None


def _shape(c: dict) -> ModelShape:
    """A `ModelShape` from config.json's keys (Hugging Face names, as in ``model.arch``)."""
    heads = int(c["num_attention_heads"])
    return ModelShape(vocab=int(c["vocab_size"]), hidden=int(c["hidden_size"]), layers=int(c["num_hidden_layers"]),
                      heads=heads, kv_heads=int(c.get("num_key_value_heads") or heads),
                      head_dim=int(c.get("head_dim") or int(c["hidden_size"]) // heads),
                      intermediate=int(c["intermediate_size"]), tied=bool(c.get("tie_word_embeddings", False)))


def local_device_index(env: Mapping[str, str] = os.environ, device_count: int = 1) -> int:
    """This process's GPU index: LOCAL_RANK, else SLURM_LOCALID; 0 when unset or that index is not visible."""
    for key in ("LOCAL_RANK", "SLURM_LOCALID"):
        if str(env.get(key, "")).isdigit():
            idx = int(env[key])
            return idx if idx < max(1, device_count) else 0
    return 0


def available_bytes(cuda: bool, local_ranks: int, device_gib: Optional[float] = None) -> int:
    """``device_gib`` GiB when given; CUDA: this rank's GPU's total memory; CPU: physical RAM / ``local_ranks``."""
    if device_gib is not None:
        return int(float(device_gib) * GIB)
    if cuda:
        import torch

        return int(torch.cuda.get_device_properties(local_device_index(os.environ, torch.cuda.device_count()))
                   .total_memory)
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // max(1, local_ranks)


def _select(cfg, key, default=None):
    from omegaconf import OmegaConf

    v = OmegaConf.select(cfg, key, default=default)
    return default if v is None else v


def _on_gpu(cfg) -> bool:
    """The run's trainer is on a GPU: cuda/gpu/auto with a visible GPU or a ``memory_plan.device_gib``."""
    import torch

    if str(_select(cfg, "trainer.accelerator", "cpu")) not in ("cuda", "gpu", "auto"):
        return False
    return torch.cuda.is_available() or _select(cfg, "memory_plan.device_gib") is not None


def _ranks(cfg) -> Tuple[int, int]:
    """(data-parallel ranks, ranks on this node)."""
    sharded = str(_select(cfg, "trainer.strategy._target_", "")) == FSDP
    devices = _select(cfg, "trainer.devices", 1)
    local = int(devices) if sharded and str(devices).isdigit() else int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return (local * int(_select(cfg, "trainer.num_nodes", 1)) if sharded else 1), local


def layout_of(cfg, shape: ModelShape, device_bytes: int) -> Layout:
    """The `Layout` of one rank of ``cfg`` on a device of ``device_bytes`` (vLLM reserves a share on a GPU)."""
    ranks, _ = _ranks(cfg)
    gpu = _on_gpu(cfg)
    b = _BYTES[str(cfg.model.get("dtype", "float32"))]
    mp = str(_select(cfg, "trainer.strategy.mixed_precision", "none"))
    if ranks > 1 or str(_select(cfg, "trainer.strategy._target_", "")) == FSDP:
        b_c = 2 if (mp in ("bf16", "bfloat16", "fp16", "float16") or (mp == "auto" and gpu)) else b
    else:
        b_c = 2 if _select(cfg, "ppo.autocast") == "bf16" else b
    n = int(_select(cfg, "rollout.sampling.n", 1))
    rows = max(int(cfg.prompts_per_step) // ranks * n,
               min(int(_select(cfg, "val.batch_size", 0)), int(_select(cfg, "val.size", 0)))  # no validation: 0
               // ranks * int(_select(cfg, "val.sampling.n", 1)))
    rows = min(rows, int(_select(cfg, "rollout.engine.batch_size", rows)))
    vllm = str(_select(cfg, "rollout.engine._target_", "")).endswith("VLLMEngine")
    e_dtype = engine_dtype(str(_select(cfg, "rollout.engine.dtype", "auto")), str(cfg.model.get("dtype", "float32")),
                           gpu)
    tp = int(_select(cfg, "rollout.engine.tensor_parallel_size", 1))
    longest = int(_select(cfg, "data.max_prompt_len", 0)) + int(_select(cfg, "rollout.sampling.max_new_tokens", 0))
    reserved = 0
    if vllm and gpu:
        reserved = int(float(_select(cfg, "rollout.engine.gpu_memory_utilization", 0.5)) * device_bytes)
    elif vllm:  # CPU: its own weights, then its KV cache space (1 GiB by default)
        reserved = int(float(_select(cfg, "rollout.engine.kv_cache_space", 1.0)) * GIB) \
            + shape.params * _BYTES.get(e_dtype, 4) // tp
    return Layout(
        ranks=ranks, dtype_bytes=b, compute_bytes=b_c,
        autocast=ranks == 1 and str(_select(cfg, "trainer.strategy._target_", "")) != FSDP and b_c < b,
        micro_tokens=int(_select(cfg, "ppo.micro_batch_max_tokens", 0)),
        activation_checkpointing=bool(_select(cfg, "trainer.strategy.activation_checkpointing", False)
                                      or _select(cfg, "model.activation_checkpointing", False)),
        head_chunk_rows=int(_select(cfg, "ppo.lm_head_chunk_rows", 0)),
        update_snapshot=bool(_select(cfg, "ppo.update_ratio", True)),
        engine="vllm" if vllm else "hf", engine_bytes=_BYTES.get(e_dtype, 4), engine_tp=tp,
        engine_sleeps=bool(vllm and gpu and _select(cfg, "rollout.engine.enable_sleep_mode", False)),
        engine_reserved=reserved, kv_rows=rows,
        kv_len=longest,
        kv_bytes=b_c if ranks > 1 else b,
        lora_rank=int(_select(cfg, "model.lora.rank", 0) or 0),
        lora_targets=tuple(t) if (t := _select(cfg, "model.lora.target_modules")) else None,
        gpu=gpu, longest_tokens=longest, rollout_rows=int(cfg.prompts_per_step) * n,  # gathered on every rank
        engine_cuda_graphs=bool(vllm and not _select(cfg, "rollout.engine.enforce_eager", False)))


def what_would_fit(shape: ModelShape, layout: Layout, budget: float) -> Optional[str]:
    """The overrides for the fewest FSDP ranks (powers of 2, bf16 compute) that fit ``budget``; None if none."""
    w = max(2, layout.ranks)
    while w <= MAX_RANKS:
        for ac in sorted({layout.activation_checkpointing, True}):
            x = replace(layout, ranks=w, compute_bytes=2, autocast=False, activation_checkpointing=ac, kv_bytes=2,
                        kv_rows=max(1, layout.kv_rows * layout.ranks // w))
            if plan_memory(shape, x).peak <= budget:
                nodes = "" if w <= 8 else f" trainer.num_nodes={w // 8}"
                return (f"FSDP over {w} GPUs (trainer=fsdp trainer.devices={min(w, 8)}{nodes}"
                        f"{' trainer.strategy.activation_checkpointing=true' if ac else ''})")
        w *= 2
    return None


def _plan(cfg, available: Optional[int]):
    """(shape, layout, plan, available bytes, where they come from, headroom), or None for an unknown shape."""
    shape = model_shape(cfg.model)
    if shape is None:
        return None
    _, local = _ranks(cfg)
    gib = _select(cfg, "memory_plan.device_gib")
    gpu = _on_gpu(cfg)
    avail = available if available is not None else available_bytes(gpu, local, gib)
    where = "memory_plan.device_gib" if gib is not None else ("CUDA" if gpu else "host RAM")
    headroom = float(_select(cfg, "memory_plan.headroom", 0.9))
    if not 0 < headroom <= 1:
        raise ValueError(f"memory_plan.headroom={headroom} must be in (0, 1] (the usable fraction), e.g. 0.9")
    layout = layout_of(cfg, shape, avail)
    return shape, layout, plan_memory(shape, layout), avail, where, headroom


def check_memory_plan(cfg, available: Optional[int] = None) -> Optional[MemoryPlan]:
    """Log the plan of ``cfg``; with ``memory_plan.check`` raise `MemoryPlanError` when its peak exceeds
    ``memory_plan.headroom`` x ``available`` or vLLM's share leaves no KV cache. None for an unknown shape."""
    found = _plan(cfg, available)
    if found is None:
        log.info("memory plan skipped: the config of %s is not available before loading (set model.arch)",
                 cfg.model.get("hub_id"))
        return None
    shape, layout, plan, avail, where, headroom = found
    log.info("%s (%.1fM parameters; available %.2f GiB %s, headroom %.2f)", plan.describe(), shape.params / 1e6,
             avail / GIB, where, headroom)
    if not bool(_select(cfg, "memory_plan.check", True)):
        return plan
    if layout.engine == "vllm" and layout.engine_reserved and _on_gpu(cfg) and plan.kv_cache <= 0:
        raise MemoryPlanError(
            f"rollout.engine.gpu_memory_utilization={_select(cfg, 'rollout.engine.gpu_memory_utilization')}: vLLM's "
            f"share ({layout.engine_reserved / GIB:.2f} GiB) does not hold its weights "
            f"({plan.engine_weights / GIB:.2f} GiB), so no KV cache is left; raise it or set "
            f"rollout.engine.tensor_parallel_size")
    if plan.peak > headroom * avail:
        fits = what_would_fit(shape, layout, headroom * avail)
        lora = None  # on these ranks: LoRA r 64 (fspo/models/lora.py) and what auto-fit adds to it
        from fspo.runtime.launch.auto_fit import fit_preview  # it plans with this module's functions

        got = fit_preview(cfg, {} if layout.lora_rank else {"model.lora.rank": 64}, avail)
        if got is not None:
            sets = ([] if layout.lora_rank else ["model.lora.rank=64"]) + got[0]
            lora = (f"{' '.join(sets) or 'memory_plan.auto_fit=true'} ({got[1] / GIB:.2f} GiB per rank; with LoRA "
                    f"the base is frozen, the adapters float32)") if sets else None
        ways = [w for w in (fits, lora) if w]
        instead = " or ".join(ways) if ways else f"neither FSDP up to {MAX_RANKS} GPUs nor LoRA r 64"
        kind = f"LoRA r {layout.lora_rank}" if layout.lora_rank else "full"
        raise MemoryPlanError(
            f"{plan.describe()} exceeds {headroom:.2f} x {avail / GIB:.2f} GiB available per rank ({where}): "
            f"a {kind} fine-tune of {shape.params / 1e9:.2f}B parameters would fit with {instead}; or lower "
            f"ppo.micro_batch_max_tokens, set ppo.lm_head_chunk_rows, or memory_plan.check=false to run anyway")
    return plan


def dry_run(cfg, available: Optional[int] = None, out: Callable[[str], None] = print) -> MemoryPlan:
    """``dry_run=true``: print the per-rank plan of ``cfg`` and whether it fits (`MemoryPlanError` if not)."""
    found = _plan(cfg, available)
    if found is None:
        raise MemoryPlanError(f"dry_run: the shape of {cfg.model.get('hub_id') or cfg.model.get('path')} is unknown "
                              f"offline: set model.arch (conf/model/*.yaml carry it) or model.path to local weights")
    shape, x, plan, avail, where, headroom = found
    names = {4: "float32", 2: "bfloat16"}
    head = f"chunked ({x.head_chunk_rows} rows)" if x.head_chunk_rows else "dense"
    engine = (f"vLLM {names.get(x.engine_bytes)} weights, tp {x.engine_tp}, "
              f"{'sleeps while training' if x.engine_sleeps else 'held throughout'}") if x.engine == "vllm" \
        else "HF generate (runs the policy itself)"
    out(f"dry run: {cfg.model.get('name')} ({shape.params / 1e9:.3f}B parameters: {shape.layers} layers, hidden "
        f"{shape.hidden}, {shape.heads}/{shape.kv_heads} heads, intermediate {shape.intermediate}, "
        f"vocab {shape.vocab})")
    out(f"  {x.ranks} data-parallel rank(s); per rank {avail / GIB:.2f} GiB ({where}), usable {headroom:.2f} x = "
        f"{headroom * avail / GIB:.2f} GiB")
    weights = (f"LoRA r {x.lora_rank}: frozen base {names.get(x.dtype_bytes)}, adapters float32" if x.lora_rank
               else f"trainable weights {names.get(x.dtype_bytes)}")
    alone = f" (the longest sequence, {x.longest_tokens}, runs alone: planned at {x.longest_tokens})" \
        if x.longest_tokens > x.micro_tokens else ""
    out(f"  {weights}, compute {names.get(x.compute_bytes)}, micro-batch {x.micro_tokens} tokens{alone}, "
        f"activation checkpointing {'on' if x.activation_checkpointing else 'off'}, LM head {head}; engine: {engine}")
    out(plan.table())
    check_memory_plan(cfg, avail)
    out(f"fits: peak {plan.peak / GIB:.2f} GiB <= {headroom * avail / GIB:.2f} GiB usable per rank")
    return plan
