"""The memory a run uses besides its tensors' formulas (one function per component of memory_components.py).

  tokens        = max(ppo.micro_batch_max_tokens, max_prompt_len + max_new_tokens): a longer sequence runs
                  alone in its micro-batch, so activations and logits are sized for the longer of the two
  cuda_context  = `CUDA_CONTEXT` per process on a GPU (CUDA context, cuBLAS/cuDNN workspaces)    resident
  nccl_buffers  = `NCCL_BUFFERS` per process with W > 1 on GPUs                                 resident
  cuda_graphs   = `CUDA_GRAPHS` with vLLM on a GPU and CUDA graphs on (outside its memory share)  resident
  root_grads    = FSDP (W > 1): the root's unsharded gradients in b_c plus the float32 reduce-scatter
                  input, (N - layers N_layer) (b_c + 4)                                          train
  rollout_batch = the gathered batch: rows x tokens of the longest sequence x 32 B               train
  fragmentation = `FRAGMENTATION` x the peak of the rest, on a GPU                               resident

The constants are allowances, not measurements: experiments/gpu_smoke.py measures a real run against the plan.
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
