"""A stop signal during a step's rollout (fspo/runtime/checkpoints/stop_signal.py): the step is abandoned, the last completed
step is saved at once, and resuming from it equals the uninterrupted run.

Owns: `interruptible` / `StepInterrupted` / `agree_stop` on one process, and the in-process run that receives
SIGTERM inside its reward (step 2) and then resumes (parameters and logged train metrics equal to a run never
stopped). Leaves out: the 2-rank torchrun launch (test_torchrun_sigterm.py) and the stop at a step boundary
(test_signals.py).
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from fspo.rewards.base import RewardOutput
from fspo.runtime.checkpoints import stop_signal
from fspo.runtime.checkpoints.files import list_checkpoints

STEPS = 3
ARGS = ["model.source=random", f"steps={STEPS}", "prompts_per_step=4", "rollout.sampling.n=4",
        "ppo.mini_batch_size=8", "ppo.mini_batch_unit=sequences", "ppo.lr=5e-4", "rollout.sampling.max_new_tokens=16", "val.size=0",
        "checkpoint.every_n_steps=0", "seed=7", f"reward._target_={__name__}.SignallingReward"]


class SignallingReward:
    """score = fraction of digit characters; with ``<output_dir>/signal_at`` holding k, the k-th call sends
    SIGTERM to this process and then works on (1 s) as a slow reward would: the signal must cut it short."""

    def __init__(self, **_):
        self.calls = 0

    def __call__(self, completions, references, lengths, overlong, max_new_tokens) -> RewardOutput:
        self.calls += 1
        at = Path(os.environ["FSPO_TEST_SIGNAL_AT"]) if "FSPO_TEST_SIGNAL_AT" in os.environ else None
        if at is not None and at.exists() and int(at.read_text()) == self.calls:
            os.kill(os.getpid(), signal.SIGTERM)
            try:
                time.sleep(1.0)
            except Exception:  # noqa: BLE001 - a reward's broad except must not swallow the stop
                pass
            raise AssertionError("the stop signal did not interrupt the reward")
        s = [sum(c.isdigit() for c in t) / max(len(t), 1) for t in completions]
        return RewardOutput(scores=s, components={"digits": s})


def test_interruptible_raises_through_except_exception():
    stop_signal.reset()
    try:
        with pytest.raises(stop_signal.StepInterrupted):
            with stop_signal.interruptible():
                try:
                    stop_signal.request_stop("SIGTERM")
                except Exception:  # noqa: BLE001
                    pass
        assert stop_signal.stop_requested() and stop_signal.agree_stop(False)  # one process: its own flag
        with pytest.raises(stop_signal.StepInterrupted):  # already requested: raised on entry
            with stop_signal.interruptible():
                pass
    finally:
        stop_signal.reset()
    assert not stop_signal.stop_requested() and not stop_signal.agree_stop(False)
    stop_signal.request_stop("SIGTERM")  # outside a block: only recorded
    assert stop_signal.agree_stop(False)
    stop_signal.reset()


def _train_loss(uri: str, out: Path):
    client = MlflowClient(uri)
    run_id = (out / "mlflow_run_id").read_text().strip()
    return {m.step: m.value for m in client.get_metric_history(run_id, "train/loss")}


def _policy(ckpt: Path):
    sd = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
    return {k: v for k, v in sd.items() if k.startswith("policy.")}


@pytest.mark.slow  # > 2.5 s: out of the quick loop (-m "not slow"), still in CI
def test_sigterm_in_reward_abandons_step_and_resume_matches(tmp_path, monkeypatch, mlflow_uri):
    from conftest import compose_config
    from fspo.train import train

    def cfg(name, extra=()):
        return compose_config([*ARGS, *extra], output_dir=tmp_path / name, tracking_uri=mlflow_uri,
                              artifact_location=tmp_path / "artifacts")

    train(cfg("full"))  # the reference, never stopped
    at = tmp_path / "signal_at"
    at.write_text("2")  # during step 2's reward
    monkeypatch.setenv("FSPO_TEST_SIGNAL_AT", str(at))
    bin_dir, calls = tmp_path / "bin", tmp_path / "scontrol_calls"  # a SLURM job that requeues itself
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\n")
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    with pytest.raises(SystemExit) as e:
        train(cfg("stopped", ["checkpoint.slurm_requeue=true"]))
    assert e.value.code in (None, 0)
    assert calls.read_text() == "requeue 4242\n"  # once, after the save
    monkeypatch.delenv("SLURM_JOB_ID")
    stopped = tmp_path / "stopped" / "checkpoints"
    assert [p.name for p in list_checkpoints(stopped)] == ["step_000001.ckpt"]  # the last completed step
    ck = torch.load(stopped / "step_000001.ckpt", map_location="cpu", weights_only=True)
    assert ck["PromptDataModule"]["sampler"]["position"] == 1 == int(ck["state_dict"]["rl_step"])
    assert sorted(_train_loss(mlflow_uri, tmp_path / "stopped")) == [0]  # step 2 logged nothing
    at.unlink()
    train(cfg("stopped", ["resume=auto"]))
    a, b = _policy(tmp_path / "full" / "checkpoints" / f"step_{STEPS:06d}.ckpt"), \
        _policy(stopped / f"step_{STEPS:06d}.ckpt")
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert diff <= 1e-6, f"max |param diff| {diff}"
    want, got = _train_loss(mlflow_uri, tmp_path / "full"), _train_loss(mlflow_uri, tmp_path / "stopped")
    assert sorted(got) == sorted(want) == list(range(STEPS))
    assert all(abs(got[s] - want[s]) <= 1e-6 * max(1.0, abs(want[s])) for s in want), (got, want)


def _synced_decoder(rank: int, port: int, out: str) -> None:
    """One of 2 gloo ranks: `decode_compact(synced=True)` (48 tokens, min 48: never ends early) inside
    `synced_stops` with a stop recorded on rank 0 only (before the first token), then the same outside it."""
    import json

    from fspo.models.tiny import build_tiny_model, build_tokenizer
    from fspo.rollout.base import SamplingConfig
    from fspo.rollout.decode import decode_compact

    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    tok, model = build_tokenizer(), build_tiny_model(seed=0)
    ids = torch.tensor([tok.encode("1+2=")] * 2)
    params = SamplingConfig(n=1, max_new_tokens=48, min_new_tokens=48, seed=rank)
    calls = []
    real = torch.distributed.all_reduce

    def counting(t, *a, **k):
        calls.append(1)
        return real(t, *a, **k)

    torch.distributed.all_reduce = counting
    if rank == 0:
        stop_signal.request_stop("SIGTERM")
    result = {}
    try:
        with stop_signal.synced_stops():
            decode_compact(model, ids, torch.ones_like(ids), params, tok.eos_token_id, tok.pad_token_id, synced=True)
        result["inside"] = "finished"
    except stop_signal.StepInterrupted:
        result["inside"] = f"interrupted after {len(calls)} all-reduces"
    dec = decode_compact(model, ids, torch.ones_like(ids), params, tok.eos_token_id, tok.pad_token_id, synced=True)
    result["outside"] = int(dec.tokens.shape[1])  # validation: a recorded stop does not cut it
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


@pytest.mark.slow  # > 2.5 s: out of the quick loop (-m "not slow"), still in CI
def test_synced_generation_stops_on_every_rank_at_the_same_token(tmp_path):
    import json

    import torch.multiprocessing as mp

    from conftest import free_port

    mp.spawn(_synced_decoder, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [g["inside"] for g in got] == ["interrupted after 1 all-reduces"] * 2  # rank 1 saw no signal
    assert [g["outside"] for g in got] == [48, 48]
