"""Guarded numerics and logging start-up: nothing non-finite reaches the optimizer, one bad reward
sample is scored 0 and counted (a NaN or an always-failing reward stops the run: test_reward_guard.py), and an
unreachable MLflow server fails fast (or falls back when asked).

Owns: NaN log-probs injected at one step (skipped and counted with ``ppo.nonfinite=skip``; a clear
error with the previous checkpoint intact with ``raise``), ``guarded_reward`` (a raising or NaN
reward sample scores 0 and is counted), the task rewards' own per-sample error handling, and the
tracking-URI probe with ``logger_fallback=local``. Leaves out: the clip rules' maths (test_clip_*).
"""
from __future__ import annotations

import logging
import math
import socket
import time
from pathlib import Path

import pytest
import torch
from omegaconf import open_dict

from conftest import SMALL
from fspo.rewards.arithmetic import ArithmeticReward
from fspo.rewards.base import RewardOutput
from fspo.rollout.callback import guarded_reward
from fspo.runtime.checkpoints.files import list_checkpoints
from fspo.update import forward as passes

BASE = [o for o in SMALL if not o.startswith("steps=")] + ["reward._target_=test_resume.DigitReward"]


def inject_nan(monkeypatch, at_step: int) -> None:
    """Make every log-prob forward of RL step ``at_step`` return NaN on its first row."""
    original = passes.log_probs

    def log_probs(module, batch, with_entropy=False, **kw):
        logp, ent = original(module, batch, with_entropy, **kw)
        if int(module.rl_step) == at_step:
            logp = logp.clone()
            logp[0] = float("nan")
        return logp, ent

    monkeypatch.setattr(passes, "log_probs", log_probs)


def history(cfg, key: str):
    """{step: value} of metric ``key`` in the run of ``cfg`` (its id from <output_dir>/mlflow_run_id)."""
    from mlflow.tracking import MlflowClient

    run_id = (Path(cfg.output_dir) / "mlflow_run_id").read_text().strip()
    client = MlflowClient(cfg.logger.tracking_uri)
    return {m.step: m.value for m in client.get_metric_history(run_id, key)}, client.get_run(run_id)


@pytest.mark.slow  # > 2.5 s: out of the quick loop (-m "not slow"), still in CI
def test_nan_log_probs_skip_the_update_and_are_counted(compose_cfg, monkeypatch):
    from fspo.train import train

    cfg = compose_cfg(BASE + ["steps=3", "checkpoint.every_n_steps=0", "val.size=0"])
    inject_nan(monkeypatch, at_step=1)
    train(cfg)
    ck = torch.load(list_checkpoints(Path(cfg.output_dir) / "checkpoints")[-1], weights_only=True)
    assert all(torch.isfinite(v).all() for v in ck["state_dict"].values() if v.is_floating_point())
    assert int(ck["state_dict"]["skipped_updates"]) == 2  # both mini-batch updates of step 1
    assert math.isfinite(float(ck["state_dict"]["clip.sigma_hat"]))
    total, _ = history(cfg, "train/skipped_updates_total")
    assert total == {0: 0.0, 1: 2.0, 2: 2.0}
    updates, _ = history(cfg, "train/updates")
    assert updates == {0: 2.0, 1: 0.0, 2: 2.0}


@pytest.mark.slow  # > 2.5 s: out of the quick loop (-m "not slow"), still in CI
def test_nonfinite_raise_stops_with_clear_error_and_keeps_checkpoint(compose_cfg, monkeypatch):
    from fspo.train import train

    cfg = compose_cfg(BASE + ["steps=4", "checkpoint.every_n_steps=2", "val.size=0", "ppo.nonfinite=raise"])
    inject_nan(monkeypatch, at_step=2)
    with pytest.raises(FloatingPointError, match="non-finite loss or gradient.*ppo.nonfinite=skip"):
        train(cfg)
    ckpts = list_checkpoints(Path(cfg.output_dir) / "checkpoints")
    assert [p.name for p in ckpts] == ["step_000002.ckpt"]
    ck = torch.load(ckpts[0], weights_only=True)
    assert int(ck["state_dict"]["rl_step"]) == 2
    assert all(torch.isfinite(v).all() for v in ck["state_dict"].values() if v.is_floating_point())
    _, run = history(cfg, "train/loss")
    assert run.info.status == "FAILED"


# ------------------------------------------------------------------ rewards
def flaky_reward(completions, references, lengths, overlong, max_new_tokens):
    """Raises on a completion containing 'boom'; NaN for one containing 'nan'; else 1."""
    if any("boom" in c for c in completions):
        raise RuntimeError("verifier crashed")
    s = [float("nan") if "nan" in c else 1.0 for c in completions]
    return RewardOutput(scores=s, components={"correct": s})


def test_guarded_reward_scores_failures_zero_and_counts_them(caplog):
    texts = ["ok", "boom", "nan", "ok too", "inf"]
    with caplog.at_level(logging.WARNING):
        out = guarded_reward(flaky_reward, texts, ["1"] * 5, [2] * 5, [False] * 5, 8)
    assert out.scores == [1.0, 0.0, 0.0, 1.0, 1.0]
    assert out.errors == 1 and out.components["nonfinite"] == [0.0, 0.0, 1.0, 0.0, 0.0]
    assert "one by one" in caplog.text
    inf = guarded_reward(lambda c, *a: RewardOutput([float("inf"), -1.0]), ["a", "b"], ["1", "1"], [1, 1],
                         [False, False], 8)
    assert inf.scores == [0.0, -1.0] and inf.components["nonfinite"] == [1.0, 0.0] and inf.errors == 0
    short = guarded_reward(lambda c, *a: RewardOutput([1.0] * len(c) if len(c) == 1 else [1.0]),
                           ["a", "b"], ["1", "1"], [1, 1], [False, False], 8)
    assert short.scores == [1.0, 1.0]  # a wrong number of scores falls back to one call per sample


def test_task_rewards_score_a_failing_sample_zero_and_count_it():
    out = ArithmeticReward()(["Answer: 3", "Answer: 4"], ["3", "not-a-number"], [9, 9], [False, False], 16)
    assert out.scores == [1.0, 0.0] and out.errors == 1
    from fspo.rewards.math_verify_reward import MathVerifyReward

    mv = MathVerifyReward()
    out = mv([None, "so \\boxed{2}"], ["1", "2"], [3, 3], [False, False], 16)  # None: extraction raises
    assert out.scores == [0.0, 1.0] and out.errors == 1
    mv.close()


class PoisonReward:
    """Raises for samples whose reference is in ``raise_on``; NaN for those in ``nan_on``; else 0.5."""

    raise_on: set = set()
    nan_on: set = set()

    def __init__(self, **_):
        pass

    def __call__(self, completions, references, lengths, overlong, max_new_tokens):
        if any(r in self.raise_on for r in references):
            raise ValueError("cannot parse reference")
        s = [float("nan") if r in self.nan_on else 0.5 for r in references]
        return RewardOutput(scores=s, components={"correct": [0.0] * len(s)})


@pytest.mark.slow  # > 2.5 s: out of the quick loop (-m "not slow"), still in CI
def test_bad_reward_samples_are_logged_and_training_goes_on(compose_cfg, monkeypatch):
    from hydra.utils import instantiate

    from fspo.data.sampler import PromptStepSampler
    from fspo.train import train

    cfg = compose_cfg(BASE + ["steps=1", "val.size=0", f"reward._target_={__name__}.PoisonReward",
                              # some raising samples tolerated (test_reward_guard.py)
                              "reward_guard.max_error_frac=0.5"])
    source = instantiate(cfg.data.train)
    first = next(iter(PromptStepSampler(len(source), int(cfg.prompts_per_step), 1, int(cfg.seed))))
    answers = [source[i].answer for i in first]
    bad = answers[0]
    monkeypatch.setattr(PoisonReward, "raise_on", {bad})
    final = train(cfg)
    n = int(cfg.rollout.sampling.n)
    assert final["reward/errors"] == n * answers.count(bad)
    assert final["reward/raised"] == pytest.approx(answers.count(bad) / len(answers))
    assert final["reward/nonfinite"] == 0  # a NaN score stops the run (test_reward_guard.py)
    assert math.isfinite(final["train/loss"]) and final["train/skipped_updates_total"] == 0


# ------------------------------------------------------------------ tracking server
def closed_port() -> int:
    """A local TCP port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_tracking_uri_fails_fast_with_clear_message(compose_cfg):
    from fspo.runtime.checks.errors import user_error
    from fspo.tracking.logger import TrackingURIUnreachable
    from fspo.train import train

    cfg = compose_cfg(BASE + ["steps=1", "val.size=0"])
    cfg.logger.tracking_uri = f"http://127.0.0.1:{closed_port()}"
    t0 = time.monotonic()
    with pytest.raises(TrackingURIUnreachable) as e:
        train(cfg)
    assert time.monotonic() - t0 < 30
    msg = user_error(e.value)  # what experiments/run.py prints (one line, exit code 2)
    assert "did not answer" in msg and "logger_fallback=local" in msg and cfg.logger.tracking_uri in msg
    assert not (Path(cfg.output_dir) / "mlflow_run_id").exists()


@pytest.mark.slow  # > 2.5 s: out of the quick loop (-m "not slow"), still in CI
def test_unreachable_tracking_uri_falls_back_to_local_store(compose_cfg, caplog):
    from mlflow.tracking import MlflowClient

    from fspo.train import train

    cfg = compose_cfg(BASE + ["steps=1", "val.size=0"])
    cfg.logger.tracking_uri = f"http://127.0.0.1:{closed_port()}"
    with open_dict(cfg):
        cfg.logger_fallback = "local"
    with caplog.at_level(logging.WARNING):
        train(cfg)
    assert "logger_fallback=local" in caplog.text
    out = Path(cfg.output_dir)
    run_id = (out / "mlflow_run_id").read_text().strip()
    client = MlflowClient(f"sqlite:///{out / 'mlflow.db'}")
    assert [m.step for m in client.get_metric_history(run_id, "train/loss")] == [0]
