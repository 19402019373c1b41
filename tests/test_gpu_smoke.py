"""experiments/gpu_smoke.py: per-phase tokens/s, MFU and peak memory of real RL steps. The CPU run
(tiny model, MFU against an explicit --peak-tflops) checks the script and its arithmetic here; the ``gpu``
variant runs the ~100M config on CUDA, and the vLLM engine's ``dtype: auto`` is checked to generate in bf16
there."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

SCRIPT = REPO / "experiments" / "gpu_smoke.py"


def test_flop_count_by_hand():
    spec = importlib.util.spec_from_file_location("gpu_smoke", SCRIPT)
    gpu_smoke = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_smoke)
    Meter = gpu_smoke.Meter

    from fspo.runtime.launch.memory_plan import model_shape

    m = Meter(model_shape({"source": "random", "arch": {}}), cuda=False)
    # tiny Qwen3: 4 layers x (246,080 - 2 norms 256 - q/k norms 64) + LM head 100 x 128 = 995,840 matmul params
    assert m.matmul == 4 * 245_760 + 12_800 == 995_840
    # 10 tokens whose sequences sum (token x length) to 100: 2 M x 10 + 2 x 4 layers x q 128 x 100
    assert m.fwd_flops(10, 100) == 2 * 995_840 * 10 + 2 * 4 * 128 * 100 == 20_019_200


def _run(args, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               HF_HUB_OFFLINE="1")
    out = tmp_path / "smoke.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), *args, "--out", str(out)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, json.loads(out.read_text())


def _check(res):
    assert set(res["phases"]) == {"generate", "old_log_probs", "update"}
    for phase, r in res["phases"].items():
        calls = [c for c in res["calls"] if c["phase"] == phase]
        assert r["calls"] == len(calls) > 0 and r["peak_mib"] > 0 and r["tokens_per_s"] > 0
        flops, secs = sum(c["flops"] for c in calls), sum(c["seconds"] for c in calls)
        assert r["mfu"] == pytest.approx(flops / secs / (res["peak_tflops"] * 1e12))
    # the default batch: 128 sequences in mini-batches of 32 -> 4 updates per step
    assert res["phases"]["update"]["calls"] == 4 * res["steps"]


@pytest.mark.slow
def test_gpu_smoke_runs_on_cpu(tmp_path):
    stdout, res = _run(["--model", "tiny", "--steps", "1", "--peak-tflops", "1.0"], tmp_path)
    _check(res)
    assert res["device"] == "cpu" and "MFU against 1 TFLOP/s" in stdout
    for phase in ("generate", "old_log_probs", "update"):
        assert f"\n{phase} " in stdout


@pytest.mark.gpu
def test_gpu_smoke_on_cuda_100m(tmp_path):
    stdout, res = _run(["--model", "qwen3_100m", "--steps", "2"], tmp_path)
    if res["peak_tflops"]:  # a card PEAK_TFLOPS knows
        _check(res)
    assert res["device"] != "cpu" and all(r["peak_mib"] > 0 for r in res["phases"].values())


@pytest.mark.gpu
def test_vllm_auto_dtype_generates_in_bf16_on_cuda(tmp_path):
    pytest.importorskip("vllm")
    import torch

    from fspo.models.tiny import build_tiny_model, build_tokenizer
    from fspo.rollout.vllm import VLLMEngine

    engine = VLLMEngine(gpu_memory_utilization=0.2, enforce_eager=True, dtype="auto")
    engine.setup(build_tiny_model(seed=0).cuda(), build_tokenizer(), str(tmp_path))  # float32 policy
    try:
        assert engine.llm.llm_engine.model_config.dtype == torch.bfloat16
    finally:
        engine.shutdown()
