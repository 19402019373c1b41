"""The memory plan of a run, per rank, printed at start-up; a layout that cannot fit is refused before
the model loads.

Owns: `ModelShape` (the numbers of a Qwen3/Llama-style decoder that memory depends on, read from the
model config: `model_shape`), `MemoryPlan` / `plan_memory` (the formulas below), `available_bytes`
(what one rank may use) and `check_memory_plan` (fspo/train.py: log the plan at INFO, raise
`MemoryPlanError` when it exceeds ``memory_plan.headroom`` x available). Leaves out: measuring real
usage (experiments/bench_memory.py) and sharding itself (fspo/runtime/distributed.py).

Per rank, with W data-parallel ranks (trainer=fsdp: ``devices x num_nodes``; else 1), b the bytes of
``model.dtype``, b_c the compute dtype's (bf16 mixed precision on CUDA: 2, else b):

  N        = V H (embedding) + [V H if untied] + H (final norm) + layers x N_layer
  N_layer  = H q + 2 H kv + q H + 3 H I + 2 H + 2 d     (q = heads x d, kv = kv_heads x d; Qwen3's q/k norms)
  params   = N b / W  +  [W > 1] (N - layers N_layer + 2 N_layer) b_c   (shards + the gathered root and
             two layers: the one computing and the one prefetched)
  grads    = N b / W
  optimizer= 2 N b / W                                  (AdamW: exp_avg and exp_avg_sq)
  activations, one micro-batch of T = ppo.micro_batch_max_tokens tokens:
             T b_c (4 H + 2 q + 2 kv + 4 I) x layers    (norm inputs, q/k/v, attention output, MLP)
             with activation checkpointing: T b_c H x layers + one layer's full set
           + T V 4                                      (one float32 logits row per token: a lower bound,
                                                         the dense head also keeps log-softmax copies)
  KV cache = 2 x layers x kv x b_c x rows x (max_prompt_len + max_new_tokens), rows = the most sequences one
             rank decodes at once: min(rollout.engine.batch_size, max(prompts_per_step/W x n,
             val.batch_size/W x val.n)) (HF engine); vLLM on CUDA reserves gpu_memory_utilization x
             device memory instead (a separate process on CPU: its kv_cache_space GiB).
  available: CUDA: the device's total memory; CPU: physical RAM / the ranks on this node.

LoRA (``model.lora.rank`` r > 0, fspo/models/lora.py; `lora_params`, `with_lora`): the base is frozen
in ``model.dtype`` and only the adapters (float32, 4 bytes) train, so with N_a = layers x sum over the
adapted linears (in -> out) of r (in + out):
  params   = N b / W + N_a 4 / W  (+ the gathered part as above)
  grads    = N_a 4 / W                                  (none for the frozen base)
  optimizer= 2 N_a 4 / W
  activations as above + T 4 r x (adapted linears) x layers (each adapter's A x)
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Optional

log = logging.getLogger(__name__)
GIB = 2 ** 30
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class MemoryPlanError(ValueError):
    """The configured layout needs more memory per rank than is available (a config error: the CLI
    shows it as one line, fspo/runtime/errors.py)."""


@dataclass(frozen=True)
class ModelShape:
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied: bool

    @property
    def layer_params(self) -> int:
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return h * q + 2 * h * kv + q * h + 3 * h * self.intermediate + 2 * h + 2 * self.head_dim

    @property
    def params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden + self.layers * self.layer_params


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per rank of each part, and the total."""
    params: int
    grads: int
    optimizer: int
    activations: int
    kv_cache: int
    ranks: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.kv_cache

    def describe(self) -> str:
        parts = ("params", "grads", "optimizer", "activations", "kv_cache")
        return (f"memory plan per rank ({self.ranks} rank(s)): "
                + ", ".join(f"{p} {getattr(self, p) / GIB:.2f}" for p in parts)
                + f"; total {self.total / GIB:.2f} GiB")


def plan_memory(shape: ModelShape, dtype_bytes: int, compute_bytes: int, ranks: int, micro_tokens: int,
                kv_rows: int, kv_len: int, activation_checkpointing: bool = False,
                engine_reserved: int = 0) -> MemoryPlan:
    """The module docstring's formulas; ``engine_reserved`` replaces the KV estimate when > 0 (vLLM)."""
    n = shape.params
    gathered = (n - shape.layers * shape.layer_params + 2 * shape.layer_params) * compute_bytes if ranks > 1 else 0
    h, q, kv = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    per_layer = micro_tokens * compute_bytes * (4 * h + 2 * q + 2 * kv + 4 * shape.intermediate)
    acts = (micro_tokens * compute_bytes * h * shape.layers + per_layer) if activation_checkpointing \
        else per_layer * shape.layers
    acts += micro_tokens * shape.vocab * 4
    kv_cache = engine_reserved or 2 * shape.layers * kv * compute_bytes * kv_rows * kv_len
    return MemoryPlan(params=n * dtype_bytes // ranks + gathered, grads=n * dtype_bytes // ranks,
                      optimizer=2 * n * dtype_bytes // ranks, activations=acts, kv_cache=kv_cache, ranks=ranks)


def _linears(shape: ModelShape) -> dict:
    """(in, out) of each linear of one Qwen3/Llama decoder layer, by name."""
    h, q, kv, i = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.intermediate
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def lora_params(shape: ModelShape, rank: int, targets=None) -> int:
    """N_a: LoRA adapter parameters, r (in + out) per adapted linear per layer (``targets``: names;
    None: all seven of attention and MLP)."""
    lin = _linears(shape)
    names = lin if targets is None else [t for t in targets if t in lin]
    return shape.layers * sum(rank * (lin[n][0] + lin[n][1]) for n in names)


def with_lora(plan: MemoryPlan, shape: ModelShape, dtype_bytes: int, rank: int, targets, micro_tokens: int
              ) -> MemoryPlan:
    """``plan`` (full fine-tuning) turned into LoRA's (module docstring): the base's gradients and
    optimizer state dropped, the float32 adapters' params, gradients and AdamW moments added."""
    w = plan.ranks
    n_a = lora_params(shape, rank, targets)
    adapted = len(_linears(shape) if targets is None else [t for t in targets if t in _linears(shape)])
    return MemoryPlan(params=plan.params + n_a * 4 // w, grads=n_a * 4 // w,
                      optimizer=2 * n_a * 4 // w,
                      activations=plan.activations + micro_tokens * 4 * rank * adapted * shape.layers,
                      kv_cache=plan.kv_cache, ranks=w)


def model_shape(model_cfg) -> Optional[ModelShape]:
    """The shape of the configured model from its config alone (no weights); None when unknown
    before loading (a hub id not in the local cache)."""
    source, path, hub_id = model_cfg.get("source"), model_cfg.get("path"), model_cfg.get("hub_id")
    if source == "random":
        from fspo.models.tiny import tiny_qwen3_config

        c = tiny_qwen3_config(**dict(model_cfg.get("arch") or {}))
    else:
        from transformers import AutoConfig

        from fspo.models.loading import WARMSTART_DIR

        where = path or (WARMSTART_DIR if source == "warmstart" else hub_id)
        try:
            c = AutoConfig.from_pretrained(str(where), local_files_only=True)
        except (OSError, ValueError):
            return None
    heads = c.num_attention_heads
    return ModelShape(vocab=c.vocab_size, hidden=c.hidden_size, layers=c.num_hidden_layers, heads=heads,
                      kv_heads=getattr(c, "num_key_value_heads", None) or heads,
                      head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
                      intermediate=c.intermediate_size, tied=bool(getattr(c, "tie_word_embeddings", False)))


def available_bytes(cuda: bool, local_ranks: int) -> int:
    """CUDA: the current device's total memory; CPU: physical RAM shared by the node's ``local_ranks``."""
    if cuda:
        import torch

        return int(torch.cuda.mem_get_info()[1])
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // max(1, local_ranks)


def _select(cfg, key, default=None):
    from omegaconf import OmegaConf

    v = OmegaConf.select(cfg, key, default=default)
    return default if v is None else v


def check_memory_plan(cfg, available: Optional[int] = None) -> Optional[MemoryPlan]:
    """Log the plan of ``cfg`` at INFO and raise `MemoryPlanError` when it exceeds
    ``memory_plan.headroom`` x ``available`` (default: `available_bytes`) with ``memory_plan.check``;
    None (logged) when the model's shape is unknown before loading."""
    import torch

    shape = model_shape(cfg.model)
    if shape is None:
        log.info("memory plan skipped: the config of %s is not available before loading", cfg.model.get("hub_id"))
        return None
    sharded = str(_select(cfg, "trainer.strategy._target_", "")).endswith("FSDP2Strategy")
    devices = _select(cfg, "trainer.devices", 1)
    local = int(devices) if sharded and str(devices).isdigit() else int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    ranks = local * int(_select(cfg, "trainer.num_nodes", 1)) if sharded else 1
    cuda = str(_select(cfg, "trainer.accelerator", "cpu")) in ("cuda", "gpu", "auto") and torch.cuda.is_available()
    b = _BYTES[str(cfg.model.get("dtype", "float32"))]
    mp = str(_select(cfg, "trainer.strategy.mixed_precision", "none"))
    b_c = 2 if (sharded and (mp in ("bf16", "bfloat16", "fp16", "float16") or (mp == "auto" and cuda))) else b
    n = int(_select(cfg, "rollout.sampling.n", 1))
    rows = max(int(cfg.prompts_per_step) // ranks * n,
               int(_select(cfg, "val.batch_size", 0)) // ranks * int(_select(cfg, "val.sampling.n", 1)))
    rows = min(rows, int(_select(cfg, "rollout.engine.batch_size", rows)))
    kv_len = int(_select(cfg, "data.max_prompt_len", 0)) + int(_select(cfg, "rollout.sampling.max_new_tokens", 0))
    avail = available if available is not None else available_bytes(cuda, local)
    util = _select(cfg, "rollout.engine.gpu_memory_utilization")
    reserved = int(float(util) * avail) if (cuda and util is not None) else 0
    plan = plan_memory(shape, b, b_c, ranks, int(_select(cfg, "ppo.micro_batch_max_tokens", 0)), rows, kv_len,
                       bool(_select(cfg, "trainer.strategy.activation_checkpointing", False)), reserved)
    rank = int(_select(cfg, "model.lora.rank", 0))
    if rank > 0:  # LoRA: frozen base, float32 adapters (fspo/models/lora.py)
        plan = with_lora(plan, shape, b, rank, _select(cfg, "model.lora.target_modules"),
                         int(_select(cfg, "ppo.micro_batch_max_tokens", 0)))
    headroom = float(_select(cfg, "memory_plan.headroom", 0.9))
    if not 0 < headroom <= 1:
        raise ValueError(f"memory_plan.headroom={headroom} must be in (0, 1] (the usable fraction), e.g. 0.9")
    log.info("%s (%.1fM parameters; available %.2f GiB %s, headroom %.2f)", plan.describe(), shape.params / 1e6,
             avail / GIB, "CUDA" if cuda else "host RAM", headroom)
    if bool(_select(cfg, "memory_plan.check", True)) and plan.total > headroom * avail:
        raise MemoryPlanError(
            f"{plan.describe()} exceeds {headroom:.2f} x {avail / GIB:.2f} GiB available per rank "
            f"({'CUDA' if cuda else 'host RAM'}): use more ranks (trainer=fsdp trainer.devices=...), "
            f"trainer.strategy.activation_checkpointing=true, a smaller ppo.micro_batch_max_tokens or "
            f"rollout.engine.batch_size, model.dtype=bfloat16, or memory_plan.check=false to run anyway")
    return plan
