"""Which dtype each copy of the weights has: the trainable (master) weights, the compute, the rollout engine's.

Trainable weights and the AdamW state are float32; computation runs in bfloat16. AdamW moves each weight by
about ``lr`` per step, and a float with ``m`` mantissa bits holding a weight ``w`` changes only in steps of

    ulp(w) = 2^(floor(log2 |w|) - m)      (bfloat16: m = 7; float16: m = 10; float32: m = 23)

so a step below ulp(w) / 2 rounds back to ``w``. At Qwen3's typical weight 0.02 bfloat16's ulp is 1.22e-4:
``lr=1e-6`` moves nothing. `master_weight_problem` refuses ``lr < ulp(TYPICAL_WEIGHT) / 2``.
"""
from __future__ import annotations

import math
from typing import Optional

TYPICAL_WEIGHT = 0.02  # Qwen3's initializer_range: the size of most of its weights
MANTISSA_BITS = {"float32": 23, "bfloat16": 7, "float16": 10}
ENGINE_AUTO_GPU = "bfloat16"  # generation dtype on GPUs; the trainer recomputes log-probs in float32


def weight_step(dtype: str, w: float = TYPICAL_WEIGHT) -> float:
    """ulp(w) in ``dtype``: the smallest change a weight of size ``w`` can make (module docstring)."""
    return 2.0 ** (math.floor(math.log2(abs(w))) - MANTISSA_BITS[dtype])


def master_weight_problem(dtype: str, lr: float, trainable: bool = True) -> Optional[str]:
    """The one-line refusal for trainable ``dtype`` weights stepped by AdamW at ``lr``, or None when fine."""
    if not trainable or dtype not in MANTISSA_BITS or dtype == "float32":
        return None
    step = weight_step(dtype)
    if lr >= step / 2:
        return None
    return (f"model.dtype={dtype} with ppo.lr={lr:g}: AdamW moves a weight by about lr per step, but a {dtype} "
            f"weight of {TYPICAL_WEIGHT} only changes in steps of {step:.2e}, so the updates round away and "
            f"nothing learns; keep float32 master weights: set model.dtype=float32 (the compute still runs in "
            f"bf16: ppo.autocast=bf16 on one device, trainer.strategy.mixed_precision=bf16 under trainer=fsdp)")


def engine_dtype(requested: str, param_dtype: str, on_gpu: bool) -> str:
    """The rollout engine's weight dtype: ``requested``, or for ``auto`` bfloat16 on a GPU and the policy's own
    ``param_dtype`` elsewhere (vLLM's CPU ``auto`` would downcast a float32 model)."""
    if requested != "auto":
        return requested
    return ENGINE_AUTO_GPU if on_gpu else param_dtype
