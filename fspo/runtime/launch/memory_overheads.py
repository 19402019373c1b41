"""The memory a run uses besides its tensors' formulas: the longest sequence's micro-batch, the process's
CUDA context, NCCL's buffers, vLLM's CUDA-graph pool, FSDP's unsharded root gradients and reduce-scatter
buffer, the gathered rollout batch and the allocator's fragmentation.

Owns: `tokens` (the tokens of the largest micro-batch) and one function per component, listed in
memory_components.py's ``COMPONENTS``. Pure arithmetic on a ``ModelShape`` ``s`` and a
``Layout`` ``x`` (memory_components.py), no torch, no config.

  tokens        = max(ppo.micro_batch_max_tokens, max_prompt_len + max_new_tokens): a sequence longer
                  than the budget runs alone in its micro-batch (fspo/update/packing.py), so the update's
                  activations and logits are sized for the longer of the two
  cuda_context  = `CUDA_CONTEXT` per process on a GPU (the CUDA context, cuBLAS/cuDNN workspaces: not
                  in torch's allocator, but in the device's memory)                             resident
  nccl_buffers  = `NCCL_BUFFERS` per process with W > 1 on GPUs (NCCL's channel buffers, NVLS)  resident
  cuda_graphs   = `CUDA_GRAPHS` with vLLM on a GPU and CUDA graphs on (rollout.engine.enforce_eager
                  false): the graph pool, outside vLLM's gpu_memory_utilization share and not freed
                  by its sleep mode                                                          resident
  root_grads    = FSDP (W > 1), the root trainable: the root's (embeddings, head, final norm: N -
                  layers N_layer) unsharded gradients in b_c plus the float32 reduce-scatter input,
                  (N - layers N_layer) (b_c + 4)                                                train
  rollout_batch = the step's batch gathered: rows x tokens of the longest sequence x 32 B (int64
                  ids and mask, float32 log-probs, old log-probs, advantages and weights)       train
  fragmentation = `FRAGMENTATION` x the peak of the rest, on a GPU (the caching allocator's
                  reserved-but-unused blocks; vLLM's sleep mode rules out expandable segments)  resident

`CUDA_CONTEXT`, `NCCL_BUFFERS`, `CUDA_GRAPHS` and `FRAGMENTATION` are allowances, not measurements of
ours: experiments/gpu_smoke.py measures a real run against the plan (docs/memory.md).
"""
from __future__ import annotations

GIB = 2 ** 30
CUDA_CONTEXT = 1 * GIB       # per process on a GPU
NCCL_BUFFERS = 1 * GIB       # per process, W > 1 on GPUs
CUDA_GRAPHS = 1 * GIB        # vLLM's captured graphs (CUDA graphs on)
FRAGMENTATION = 0.05         # of the rest's peak, on a GPU
ROLLOUT_BYTES_PER_TOKEN = 32


def tokens(x) -> int:
    """Tokens of the largest micro-batch: the budget, or the longest sequence when it is longer."""
    return max(x.micro_tokens, x.longest_tokens)


def cuda_context(s, x) -> int:
    return CUDA_CONTEXT if x.gpu else 0


def nccl_buffers(s, x) -> int:
    return NCCL_BUFFERS if x.gpu and x.ranks > 1 else 0


def cuda_graphs(s, x) -> int:
    return CUDA_GRAPHS if x.gpu and x.engine == "vllm" and x.engine_cuda_graphs else 0


def root_grads(s, x) -> int:
    if x.ranks <= 1 or x.lora_rank > 0:  # LoRA: the root (embeddings, head) is frozen
        return 0
    return (s.params - s.layers * s.layer_params) * (x.compute_bytes + 4)


def rollout_batch(s, x) -> int:
    return x.rollout_rows * x.longest_tokens * ROLLOUT_BYTES_PER_TOKEN


def fragmentation(rest_peak: int, x) -> int:
    return int(FRAGMENTATION * rest_peak) if x.gpu else 0
