"""Pipelined rollouts (``rollout.overlap``): the engine process, its weight slots, the
pipeline's schedule and staleness, a real run with overlap on, its resume, and the refused settings.

The engine-process tests spawn the real child (fspo/rollout/async_engine.py) on the tiny Qwen3. The
schedule test drives `RolloutPipeline` with `RecordingEngine`, a test double that records which
weights each request was given instead of generating (the schedule is what is tested there; the
real child's use of its slot is tested against the in-process engine).
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from fspo.models.tiny import build_tiny_model, build_tokenizer
from fspo.rollout.async_engine import AsyncEngine
from fspo.rollout.base import SamplingConfig
from fspo.rollout.hf import HFEngine
from fspo.rollout.pipeline import OverlapConfig, RolloutPipeline
from fspo.runtime.checks.config_check import ConfigError, _cross_checks

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
PARAMS = SamplingConfig(n=2, temperature=1.0, max_new_tokens=6, seed=11)


def _in_process(model, tok):
    eng = HFEngine(batch_size=64)
    eng.setup(model, tok, "")
    return eng.generate(PROMPTS, PARAMS)


def _same(a, b):
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.response_mask, b.response_mask)
    torch.testing.assert_close(a.engine_log_probs, b.engine_log_probs, atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(1)
    tok, model = build_tokenizer(), build_tiny_model(seed=0, initializer_range=0.5)
    eng = AsyncEngine(HFEngine(batch_size=64), slots=2, threads=1)
    eng.start(model, tok)
    yield eng, tok
    eng.close()


def test_engine_process_generates_what_the_in_process_engine_does(engine):
    eng, tok = engine
    model = build_tiny_model(seed=0, initializer_range=0.5)
    eng.push(model, 0)
    eng.submit(0, PROMPTS, PARAMS)
    _same(eng.result(), _in_process(model, tok))


def test_each_request_uses_the_weights_of_its_slot(engine):
    """Slot 0 holds model A, slot 1 model B; two requests queued back to back get A's and B's rollouts."""
    eng, tok = engine
    a, b = build_tiny_model(seed=1, initializer_range=0.5), build_tiny_model(seed=2, initializer_range=0.5)
    eng.push(a, 0)
    eng.push(b, 1)
    eng.submit(0, PROMPTS, PARAMS)
    eng.submit(1, PROMPTS, PARAMS)
    ra, rb = eng.result(), eng.result()
    _same(ra, _in_process(a, tok))
    _same(rb, _in_process(b, tok))
    assert not torch.equal(ra.engine_log_probs, rb.engine_log_probs)


def test_child_errors_come_back_with_their_traceback(engine):
    eng, _ = engine
    eng.submit(0, [[5] * 600], SamplingConfig(n=1, max_new_tokens=4, seed=0))  # beyond max_position_embeddings
    with pytest.raises(RuntimeError,
                       match="the rollout engine process failed: ValueError: prompt length 600 "
                             ".*max_position_embeddings"):
        eng.result()


class RecordingEngine:
    """Test double of AsyncEngine: a "rollout" is the weight version its slot held when requested."""

    def __init__(self):
        self.slots, self.queue, self.log = {}, [], []

    def push(self, policy, slot):
        self.slots[slot] = policy["version"]

    def submit(self, slot, prompt_ids, params):
        self.queue.append((params.seed, self.slots[slot]))

    def result(self):
        return self.queue.pop(0)

    def close(self):
        pass


@pytest.mark.parametrize("k", [1, 2, 3])
def test_schedule_gives_step_t_the_weights_of_the_end_of_step_t_minus_1_minus_k(k):
    """At the start of step t the trainer holds W_{t-1}; step t's rollout was sampled with W_{t-1-k}
    (W_{-1} for the first k steps, which start from the initial weights), and nothing is requested
    past the last step."""
    pipe, last = RolloutPipeline(RecordingEngine(), staleness=k), 7
    got = []
    for t in range(last + 1):
        policy = {"version": t - 1}  # W_{t-1}
        seed, version = pipe.take(t, last, policy, lambda s: ([], SamplingConfig(seed=s)))
        assert seed == t  # the request for step t
        assert pipe.lag == (t - 1) - version  # steps between the sampling weights and the trainer's
        got.append(version)
    assert got == [max(t - 1 - k, -1) for t in range(last + 1)]
    assert pipe.engine.queue == [] and pipe.in_flight == []


def test_a_resumed_pipeline_starts_over_with_the_current_weights():
    pipe = RolloutPipeline(RecordingEngine(), staleness=1)
    pipe.take(0, 9, {"version": -1}, lambda s: ([], SamplingConfig(seed=s)))  # step 1 in flight with W_{-1}
    seed, version = pipe.take(5, 9, {"version": 4}, lambda s: ([], SamplingConfig(seed=s)))  # a resume at step 5
    assert (seed, version) == (5, 4) and pipe.in_flight == [6] and pipe.lag == 0


def test_overlap_settings_are_checked():
    with pytest.raises(ValueError, match="staleness must be >= 1"):
        OverlapConfig(enable=True, staleness=0)
    base = {"rollout": {"overlap": {"enable": True}, "engine": {"_target_": "fspo.rollout.hf.HFEngine"},
                        "dynamic_sampling": {"enable": False}},
            "ppo": {"old_log_probs": "engine"}, "trainer": {"strategy": None}}
    _cross_checks(OmegaConf.create(base), [])  # valid
    fsdp = OmegaConf.merge(OmegaConf.create(base), OmegaConf.from_dotlist(  # FSDP: an engine process per rank
        ["trainer.strategy={_target_: fspo.runtime.launch.distributed.FSDP2Strategy}"]))
    _cross_checks(fsdp, [])
    for over, fix in ((["ppo.old_log_probs=recompute"], "set ppo.old_log_probs=engine"),
                      (["rollout.engine._target_=fspo.rollout.vllm.VLLMEngine"], "use rollout=hf"),
                      (["rollout.dynamic_sampling.enable=true"], "set rollout.dynamic_sampling.enable=false"),
                      (["trainer.accelerator=gpu"], r"rollout=vllm rollout.overlap.enable=false")):
        cfg = OmegaConf.merge(OmegaConf.create(base), OmegaConf.from_dotlist(over))
        with pytest.raises(ConfigError, match=f"rollout.overlap.enable=True: .*{fix}"):
            _cross_checks(cfg, [])


@pytest.mark.slow
def test_run_with_overlap_trains_logs_and_resumes(tmp_path):
    """3 steps with rollout.overlap.enable=true, then resume=auto to step 5: both exit 0; the MLflow run
    holds every step once; from step 1 on the batch is one step stale, which the engine-vs-trainer
    log-prob gap shows (float32 noise, < 1e-5, at step 0, where both hold the same weights)."""
    import mlflow

    out, db = tmp_path / "out", tmp_path / "mlflow.db"
    args = [sys.executable, str(ROOT / "experiments" / "run.py"), "prompts_per_step=8", "rollout.sampling.n=4",
            "ppo.mini_batch_size=8", "ppo.mini_batch_unit=sequences", "rollout.sampling.max_new_tokens=40",
            "ppo.lr=5e-4", "val.size=4",
            "val.every_n_steps=100",
            "rollout.overlap.enable=true", f"hydra.run.dir={out}", f"logger.tracking_uri=sqlite:///{db}",
            "checkpoint.every_n_steps=1"]
    first = subprocess.run(args + ["steps=3"], capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    again = subprocess.run(args + ["steps=5", "resume=auto"], capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    client = mlflow.tracking.MlflowClient(f"sqlite:///{db}")
    run = client.search_runs([client.get_experiment_by_name("fspo").experiment_id])[0]
    gap = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "rollout/logprob_gap")}
    assert sorted(gap) == [0, 1, 2, 3, 4]
    assert gap[0] < 1e-5 < min(gap[1], gap[2])  # float32 noise at step 0; a policy lag after
    # the stale first batch: a stale step measures all 4 mini-batches of 8 (32 sequences), a step
    # whose request used the current weights (0, and 3: the resumed pipeline starts over) only the last 3
    from fspo.diagnostics.metric_keys import display_key  # counts are shown in the last chart section

    n = {m.step: m.value for m in client.get_metric_history(run.info.run_id, display_key("logratio/n"))}
    assert all(n[s] > 24 for s in (1, 2, 4)) and all(n[s] <= 24 for s in (0, 3)), n
