"""Stop signals and atomic checkpoint writes.

Owns: SIGTERM / SIGUSR1 sent to a running `experiments/run.py` (a complete checkpoint at the step
boundary, exit code 0, nothing logged past it, MLflow run KILLED), and checkpoint writes cut short
(an exception mid-write, and SIGKILL mid-write in a subprocess) leaving the previous checkpoint
intact; keep-last-k. Leaves out: resuming (test_resume.py).
"""
from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_resume import ARGS, last_train_step, start_run

from fspo.runtime.checkpoints.checkpointing import StepCheckpoint
from fspo.runtime.checkpoints.files import list_checkpoints
from fspo.runtime.checkpoints.resume import latest_complete_checkpoint

SIG_ARGS = [a for a in ARGS if not a.startswith(("steps=", "checkpoint.every_n_steps="))] + \
    ["steps=40", "checkpoint.every_n_steps=0"]  # checkpoints only on the signal (and after step 40)


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGUSR1"])
def test_signal_saves_at_step_boundary_and_exits_0(tmp_path, sig):
    run = start_run(tmp_path, "run", args=SIG_ARGS)
    db, out = tmp_path / "run.db", tmp_path / "run"
    deadline = time.monotonic() + 300
    while last_train_step(db) < 1:
        assert run.poll() is None and time.monotonic() < deadline, "the run ended or hung before the signal"
        time.sleep(0.05)
    os.kill(run.pid, getattr(signal, sig))
    rc = run.wait(timeout=300)
    log = "\n".join(p.read_text()[-3000:] for p in tmp_path.glob("*.log"))
    assert rc == 0, f"exit code {rc}:\n{log}"
    ckpts = list_checkpoints(out / "checkpoints")
    assert len(ckpts) == 1, ckpts
    step = int(ckpts[0].stem.split("_")[1])
    assert 2 <= step < 40
    ck = torch.load(ckpts[0], map_location="cpu", weights_only=True)  # complete and loadable
    assert int(ck["state_dict"]["rl_step"]) == step == ck["fspo_resume"]["rl_step"]
    assert ck["PromptDataModule"]["sampler"]["position"] == step
    assert not list((out / "checkpoints").glob("*.partial"))
    assert last_train_step(db) == step - 1  # stopped at the boundary: no step beyond the checkpoint
    with sqlite3.connect(db) as con:
        (status,) = con.execute("SELECT status FROM runs").fetchone()
        tags = dict(con.execute("SELECT key, value FROM tags").fetchall())
    assert status == "KILLED" and tags["fspo.stopped_at_step"] == str(step)


@pytest.mark.parametrize("hook", ["on_train_batch_start", "on_validation_batch_start"])
@pytest.mark.slow  # > 2.5 s: out of the quick loop (-m "not slow"), still in CI
def test_sigterm_near_a_validation_saves_after_it(compose_cfg, monkeypatch, hook):
    """SIGTERM during step 2's update (validation follows: the save waits for it) or during the
    validation after step 2 (Lightning stops after it): either way step_000002.ckpt follows the
    validation logged at step 2, and the stop is a SystemExit with code 0."""
    from mlflow.tracking import MlflowClient

    from fspo.rollout.callback import RolloutCallback
    from fspo.train import train

    cfg = compose_cfg([a for a in ARGS if not a.startswith(("steps=", "val.every_n_steps=", "checkpoint."))]
                      + ["steps=6", "val.every_n_steps=2", "checkpoint.every_n_steps=0"])
    original = getattr(RolloutCallback, hook)

    def signalling(self, trainer, pl_module, batch, batch_idx, *rest):
        # after step 2's rollout (a signal during it abandons the step: test_stop_signal.py), or before validation
        out = original(self, trainer, pl_module, batch, batch_idx, *rest) if hook == "on_train_batch_start" else None
        if trainer.state.fn == "fit" and int(pl_module.rl_step) == (1 if hook == "on_train_batch_start" else 2):
            os.kill(os.getpid(), signal.SIGTERM)
        return out if hook == "on_train_batch_start" else original(self, trainer, pl_module, batch, batch_idx, *rest)

    monkeypatch.setattr(RolloutCallback, hook, signalling)
    with pytest.raises(SystemExit) as e:
        train(cfg)
    assert e.value.code in (None, 0)
    assert [p.name for p in list_checkpoints(Path(cfg.output_dir) / "checkpoints")] == ["step_000002.ckpt"]
    client = MlflowClient(cfg.logger.tracking_uri)
    run = client.get_run((Path(cfg.output_dir) / "mlflow_run_id").read_text().strip())
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "val/accuracy")) == [0, 2]
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "train/loss")) == [0, 1]
    assert run.info.status == "KILLED"


# ------------------------------------------------------------------ atomic writes
class FakeStrategy:
    """The two strategy calls `StepCheckpoint._save` makes, on one process."""

    def barrier(self, name=None):
        pass

    def reduce_boolean_decision(self, decision, all=True):
        return decision


class FakeTrainer:
    """A trainer whose ``save_checkpoint(path)`` is ``writer(path)``."""

    is_global_zero, global_rank, world_size = True, 0, 1

    def __init__(self, writer):
        self.strategy, self.writer = FakeStrategy(), writer

    def save_checkpoint(self, path, weights_only=False):
        self.writer(path)


def good_writer(step):
    """A writer of a small, valid checkpoint for ``step``."""
    return lambda p: torch.save({"fspo_resume": {"rl_step": step}, "w": torch.arange(1000.0) * step}, p)


def test_failed_write_keeps_previous_checkpoint_and_keep_last(tmp_path):
    ck = tmp_path / "checkpoints"
    cb = StepCheckpoint(ck, every_n_steps=2, keep_last=2)
    cb._save(FakeTrainer(good_writer(2)), 2)
    before = (ck / "step_000002.ckpt").read_bytes()

    def crash(p):
        Path(p).write_bytes(before[: len(before) // 2])  # half written, then the disk fills up
        raise OSError(28, "No space left on device (simulated)")

    with pytest.raises(OSError):
        cb._save(FakeTrainer(crash), 4)
    assert list_checkpoints(ck) == [ck / "step_000002.ckpt"]
    assert (ck / "step_000002.ckpt").read_bytes() == before
    assert latest_complete_checkpoint(tmp_path) == ck / "step_000002.ckpt"
    for s in (4, 6, 8):
        cb._save(FakeTrainer(good_writer(s)), s)
    assert [p.name for p in list_checkpoints(ck)] == ["step_000006.ckpt", "step_000008.ckpt"]  # keep_last=2
    assert not list(ck.glob("*.partial"))  # the next save removed the stale partial
    assert torch.load(ck / "step_000008.ckpt", weights_only=True)["fspo_resume"]["rl_step"] == 8


SLOW_WRITER = """
import sys, time
from pathlib import Path
from fspo.runtime.checkpoints.checkpointing import StepCheckpoint
from test_signals import FakeTrainer

def slow(p):
    with open(p, "wb") as f:
        for _ in range(2000):
            f.write(b"x" * (1 << 16)); f.flush(); time.sleep(0.01)

StepCheckpoint(Path(sys.argv[1]), keep_last=1)._save(FakeTrainer(slow), 4)
"""


@pytest.mark.slow  # > 2.5 s: out of the quick loop (-m "not slow"), still in CI
def test_kill9_during_write_keeps_previous_checkpoint(tmp_path):
    ck = tmp_path / "checkpoints"
    StepCheckpoint(ck, keep_last=1)._save(FakeTrainer(good_writer(2)), 2)
    before = (ck / "step_000002.ckpt").read_bytes()
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), str(Path(__file__).parents[1])])}
    proc = subprocess.Popen([sys.executable, "-c", SLOW_WRITER, str(ck)], env=env)
    partial = ck / "step_000004.ckpt.partial"
    deadline = time.monotonic() + 120
    while not (partial.exists() and partial.stat().st_size > (1 << 20)):
        assert proc.poll() is None and time.monotonic() < deadline, "the writer ended before it was killed"
        time.sleep(0.02)
    proc.kill()  # SIGKILL mid-write
    proc.wait()
    assert list_checkpoints(ck) == [ck / "step_000002.ckpt"]  # keep_last=1 would have deleted it after a commit
    assert (ck / "step_000002.ckpt").read_bytes() == before
    assert latest_complete_checkpoint(tmp_path) == ck / "step_000002.ckpt"
