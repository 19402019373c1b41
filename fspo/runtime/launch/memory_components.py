"""The per-rank memory of a run, one function per component: the formulas of the memory plan.

Pure arithmetic, no torch and no config. To add a component, list its ``(shape, layout) -> bytes`` function
and its phase in `COMPONENTS`.

Per rank, with W data-parallel ranks, b the bytes of the trainable (master) dtype, b_c the compute
dtype's (bf16 compute: 2), N the parameters and P the trainable ones (N for a full fine-tune):

  N        = V H (embedding) + [V H if untied] + H (final norm) + layers x N_layer
  N_layer  = H q + 2 H kv + q H + 3 H I + 2 H + 2 d     (q = heads x d, kv = kv_heads x d; Qwen3's q/k norms)
  weights         = N b / W                                  resident
  compute_weights = W > 1: (N - layers N_layer + 2 N_layer) b_c (FSDP: the gathered root and two
                    layers, the one computing and the one prefetched); W = 1 and b_c < b: N b_c
                    (autocast's bf16 copies, saved for backward); else 0                 train
  adapters        = LoRA (model.lora.rank r > 0): N_a 4 / W, N_a = layers x sum over the adapted linears
                    (in -> out) of r (in + out); the adapters are float32 whatever the base's dtype  resident
  grads           = P b_t / W  (b_t = b; LoRA: P = N_a, b_t = 4: the frozen base has none)   resident
  optimizer       = 2 P b_t / W  (AdamW exp_avg, exp_avg_sq) resident
  update_snapshot = P b_t / W  (train/update_ratio's copy; fspo/update/update_ratio.py)   train
  adapter_activations = LoRA: T 4 r x (adapted linears) x layers (each adapter's A x)     train
  activations, one micro-batch of T tokens (T = max(ppo.micro_batch_max_tokens, the longest sequence):
                    a longer sequence runs alone), per token and layer:                           train
                    one dtype (no autocast): b_c (6 H + 4 q + 4 kv + 4 I) + n;
                    ppo.autocast=bf16 (float32 weights, bf16 compute on one device): 4 (6 H + 2 q + 2 kv)
                    + 2 (7 H + 2 q + 2 kv + 6 I) + n (the float32 residual stream and RMSNorms, and a bf16
                    copy of its input for each linear); n = 4 (2 + 2 heads + kv_heads), the norms' scales;
                    x T x layers; activation checkpointing: T b_r H x layers + one layer's full set
                    (b_r: 4 under autocast, the float32 residual, else b_c)
  logits          = dense: T V (20 + b_c if b_c < 4 else 20) (the float32 logits saved for backward, 4,
                    and 16 of temporaries in the log-softmax's backward; + the head's bf16 output);
                    chunked (ppo.lm_head_chunk_rows = c > 0): min(T, c) V 4 x 2  train
                    Activations and logits are measured on the real forward + backward (tests/test_memory_measured.py).
  engine_weights  = vLLM: N b_e / tp (its own copy, b_e its dtype); HF engine: 0 (it runs the policy)
  kv_cache        = vLLM on a GPU: reserved - engine_weights (reserved = gpu_memory_utilization x device
                    memory, which covers weights and KV cache); vLLM on CPU: its kv_cache_space;
                    HF: 2 x layers x kv x b_kv x rows x (max_prompt_len + max_new_tokens)
                    engine parts: phase generate when the engine sleeps during training (vLLM sleep
                    mode on a GPU), else resident; HF's KV cache: generate
  cuda_context, nccl_buffers, cuda_graphs, root_grads, rollout_batch, fragmentation: what the
                    tensors above leave out (memory_overheads.py)
  peak            = resident + max(train, generate)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple, Union

from fspo.runtime.launch.memory_overheads import (
    GIB,
    cuda_context,
    cuda_graphs,
    fragmentation,
    nccl_buffers,
    rollout_batch,
    root_grads,
    tokens,
)


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
class Layout:
    """How one run places the model (module docstring's symbols)."""
    ranks: int = 1                    # W
    dtype_bytes: int = 4              # b: trainable (master) weights, grads and AdamW state
    compute_bytes: int = 4            # b_c
    autocast: bool = False            # ppo.autocast=bf16 on one device: float32 weights, bf16 compute
    micro_tokens: int = 8192          # T
    activation_checkpointing: bool = False
    head_chunk_rows: int = 0          # c; 0: dense head
    update_snapshot: bool = True      # ppo.update_ratio
    engine: str = "hf"                # hf | vllm
    engine_bytes: int = 4             # b_e (vLLM)
    engine_tp: int = 1
    engine_sleeps: bool = False       # vLLM sleep mode on a GPU: engine memory only while generating
    engine_reserved: int = 0          # vLLM: bytes it reserves (GPU: utilization x device; CPU: weights + kv space)
    kv_rows: int = 0                  # HF engine: sequences one rank decodes at once
    kv_len: int = 0                   # HF engine: max_prompt_len + max_new_tokens
    kv_bytes: int = 4                 # HF engine: b_kv
    trainable_params: Optional[int] = None  # P; None: every parameter (full fine-tune)
    lora_rank: int = 0                # r; 0: no LoRA (model.lora.rank)
    lora_targets: Optional[Tuple[str, ...]] = None  # adapted linears; None: all seven of attention and MLP
    gpu: bool = False                 # the trainer is on a GPU (CUDA context, NCCL, fragmentation)
    longest_tokens: int = 0           # max_prompt_len + max_new_tokens: the longest sequence a run can produce
    rollout_rows: int = 0             # sequences of the step's batch one rank holds during the update
    engine_cuda_graphs: bool = False  # vLLM on a GPU with CUDA graphs (rollout.engine.enforce_eager false)


def linears(s: ModelShape) -> Dict[str, Tuple[int, int]]:
    """(in, out) of each linear of one Qwen3/Llama decoder layer, by name."""
    h, q, kv, i = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim, s.intermediate
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def _adapted(s: ModelShape, x: Layout):
    lin = linears(s)
    return [n for n in (lin if x.lora_targets is None else x.lora_targets) if n in lin]


def lora_params(s: ModelShape, x: Layout) -> int:
    """N_a = layers x sum over the adapted linears (in -> out) of r (in + out); 0 without LoRA."""
    lin = linears(s)
    return s.layers * sum(x.lora_rank * (lin[n][0] + lin[n][1]) for n in _adapted(s, x)) if x.lora_rank > 0 else 0


def _trainable_bytes(s: ModelShape, x: Layout) -> int:
    """P b_t: LoRA adapters are float32 whatever the base's dtype (the frozen base has no gradients)."""
    if x.lora_rank > 0:
        return lora_params(s, x) * 4
    return (s.params if x.trainable_params is None else x.trainable_params) * x.dtype_bytes


def compute_weights(s: ModelShape, x: Layout) -> int:
    if x.ranks > 1:
        return (s.params - s.layers * s.layer_params + 2 * s.layer_params) * x.compute_bytes
    return s.params * x.compute_bytes if x.compute_bytes < x.dtype_bytes else 0


def adapter_activations(s: ModelShape, x: Layout) -> int:
    return tokens(x) * 4 * x.lora_rank * len(_adapted(s, x)) * s.layers if x.lora_rank > 0 else 0


def activation_bytes_per_token(s: ModelShape, x: Layout) -> int:
    """Bytes one token leaves saved for backward in one decoder layer (module docstring, measured)."""
    h, q, kv, i = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim, s.intermediate
    norms = 4 * (2 + 2 * s.heads + s.kv_heads)  # float32 RMSNorm scales: 2 per token, q/k norms per head
    if x.autocast:
        return 4 * (6 * h + 2 * q + 2 * kv) + 2 * (7 * h + 2 * q + 2 * kv + 6 * i) + norms
    return x.compute_bytes * (6 * h + 4 * q + 4 * kv + 4 * i) + norms


def activations(s: ModelShape, x: Layout) -> int:
    per_layer = tokens(x) * activation_bytes_per_token(s, x)
    if x.activation_checkpointing:
        return tokens(x) * (4 if x.autocast else x.compute_bytes) * s.hidden * s.layers + per_layer
    return per_layer * s.layers


def logits(s: ModelShape, x: Layout) -> int:
    if x.head_chunk_rows > 0:
        return min(tokens(x), x.head_chunk_rows) * s.vocab * 4 * 2
    return tokens(x) * s.vocab * (20 + (x.compute_bytes if x.compute_bytes < 4 else 0))


def engine_weights(s: ModelShape, x: Layout) -> int:
    return s.params * x.engine_bytes // x.engine_tp if x.engine == "vllm" else 0


def kv_cache(s: ModelShape, x: Layout) -> int:
    if x.engine == "vllm":
        return x.engine_reserved - engine_weights(s, x)
    return 2 * s.layers * s.kv_heads * s.head_dim * x.kv_bytes * x.kv_rows * x.kv_len


def _engine_phase(x: Layout) -> str:
    return "generate" if x.engine_sleeps else "resident"


# (name, size, phase): phase is "resident" (held throughout), "train" (the update) or "generate" (rollouts),
# or a function of the layout
COMPONENTS: Tuple[Tuple[str, Callable[[ModelShape, Layout], int], Union[str, Callable[[Layout], str]]], ...] = (
    ("weights", lambda s, x: s.params * x.dtype_bytes // x.ranks, "resident"),
    ("compute_weights", compute_weights, "train"),
    ("adapters", lambda s, x: lora_params(s, x) * 4 // x.ranks, "resident"),
    ("grads", lambda s, x: _trainable_bytes(s, x) // x.ranks, "resident"),
    ("optimizer", lambda s, x: 2 * _trainable_bytes(s, x) // x.ranks, "resident"),  # AdamW exp_avg, exp_avg_sq
    ("update_snapshot", lambda s, x: _trainable_bytes(s, x) // x.ranks if x.update_snapshot else 0, "train"),
    ("activations", activations, "train"),
    ("lora_activations", adapter_activations, "train"),
    ("logits", logits, "train"),
    ("engine_weights", engine_weights, _engine_phase),
    ("kv_cache", kv_cache, lambda x: _engine_phase(x) if x.engine == "vllm" else "generate"),
    ("cuda_context", cuda_context, "resident"),
    ("nccl_buffers", nccl_buffers, "resident"),
    ("cuda_graphs", cuda_graphs, "resident"),
    ("root_grads", root_grads, "train"),
    ("rollout_batch", rollout_batch, "train"),
)  # then fragmentation (`plan_memory`): a share of the peak of these


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per rank of each component (`COMPONENTS` order), its phase, and the peak."""
    parts: Dict[str, int]
    phases: Dict[str, str]
    ranks: int

    def phase_total(self, phase: str) -> int:
        return sum(v for k, v in self.parts.items() if self.phases[k] == phase)

    @property
    def peak(self) -> int:
        return self.phase_total("resident") + max(self.phase_total("train"), self.phase_total("generate"))

    def __getattr__(self, name: str) -> int:  # plan.grads, plan.kv_cache, ...
        parts = self.__dict__.get("parts") or {}
        if name in parts:
            return parts[name]
        raise AttributeError(name)

    def describe(self) -> str:
        """One line: every component in GiB and the peak."""
        return (f"memory plan per rank ({self.ranks} rank(s)): "
                + ", ".join(f"{k} {v / GIB:.2f}" for k, v in self.parts.items() if v)
                + f"; peak {self.peak / GIB:.2f} GiB (train {self.phase_total('train') / GIB:.2f}, generate "
                  f"{self.phase_total('generate') / GIB:.2f} on top of resident "
                  f"{self.phase_total('resident') / GIB:.2f})")

    def table(self) -> str:
        """The plan as a table, a line per component (the dry run prints it)."""
        rows = [f"  {'component':<16} {'phase':<9} {'GiB':>9}"]
        rows += [f"  {k:<16} {self.phases[k]:<9} {v / GIB:>9.2f}" for k, v in self.parts.items()]
        rows.append(f"  {'peak':<16} {'':<9} {self.peak / GIB:>9.2f}   (resident + max(train, generate))")
        return "\n".join(rows)


def plan_memory(shape: ModelShape, layout: Layout) -> MemoryPlan:
    """Every component of `COMPONENTS`, then the allocator's fragmentation as a share of their peak."""
    parts = {name: int(size(shape, layout)) for name, size, _ in COMPONENTS}
    phases = {name: phase if isinstance(phase, str) else phase(layout) for name, _, phase in COMPONENTS}
    rest = MemoryPlan(parts=parts, phases=phases, ranks=layout.ranks)
    return MemoryPlan(parts={**parts, "fragmentation": fragmentation(rest.peak, layout)},
                      phases={**phases, "fragmentation": "resident"}, ranks=layout.ranks)
