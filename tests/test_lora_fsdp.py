"""FSDP + LoRA on 2 gloo ranks equals one process: same adapters, same merged weights (what the vLLM
sync streams, gathered one tensor at a time), same step metrics, the frozen base untouched.

Owns: the comparison; the worker is tests/fsdp_lora_worker.py (torchrun, 2 CPU processes), the
reference runs in this process. Leaves out: LoRA's math (tests/test_lora.py).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO

SKIP = ("time/", "perf/")


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp_lora_two_ranks_equal_one_process(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(REPO / "tests" / "fsdp_lora_worker.py"), str(tmp_path)],
                          env=env, cwd=str(REPO), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    import fsdp_lora_worker

    one = fsdp_lora_worker.run_lora_step(1, tmp_path / "one")
    two = torch.load(tmp_path / "lora_w2.pt", weights_only=False)
    assert two["sharded"] and not one["sharded"]
    assert two["counts"] == one["counts"] and one["counts"]["model/trainable_params"] == 4 * 4 * 2816
    assert one["metrics"]["train/updates"] == 2.0 and one["metrics"]["train/update_ratio"] > 0
    from fspo.models.tiny import build_tiny_model

    base = build_tiny_model(seed=0).state_dict()
    moved = max(float((one["merged"][k] - base[k]).abs().max()) for k in base)
    assert moved > 1e-4, "the adapters did not move the merged weights: the comparison would be vacuous"
    for k in one["adapters"]:
        assert torch.allclose(one["adapters"][k], two["adapters"][k], atol=1e-5), k
    for k in base:
        assert torch.allclose(one["merged"][k], two["merged"][k], atol=1e-5), k
        if "proj" not in k:  # not adapted (embeddings, norms): the frozen base, bit for bit
            assert torch.equal(two["merged"][k], base[k]), k
    keys = {k for k in one["metrics"] if not k.startswith(SKIP)}
    assert keys == {k for k in two["metrics"] if not k.startswith(SKIP)}
    for k in sorted(keys):
        tol = 1e-5 if k.startswith("logratio/") else 1e-6
        assert two["metrics"][k] == pytest.approx(one["metrics"][k], rel=1e-5, abs=tol), k
