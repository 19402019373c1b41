"""Stop signals: where in a run a SIGTERM / SIGUSR1 / Ctrl-C lands decides what is saved, and nothing is lost.

Owns:
- at a step boundary: SIGTERM / SIGUSR1 sent to a running `experiments/run.py` (a complete checkpoint at the
  step boundary, exit code 0, nothing logged past it, MLflow run KILLED), and SIGTERM near a validation (the
  save follows the validation);
- during a step's rollout (fspo/runtime/checkpoints/stop_signal.py): `interruptible` / `StepInterrupted` /
  `agree_stop` on one process; an in-process run that receives SIGTERM inside its reward (step 2) abandons the
  step, saves the last completed one, requeues a SLURM job once, and resumed equals a run never stopped
  (parameters and logged train metrics); synced generation on 2 gloo ranks stops on both at the same token;
- SIGTERM to the torchrun launcher (not to the ranks) during a 2-rank gloo run of ``trainer=fsdp``, as SLURM,
  Kubernetes and other schedulers send it: a complete, loadable checkpoint, an exit within the launcher's
  grace, no rank left alive, and ``resume=auto`` completes the run. torchrun's agent forwards the SIGTERM to
  every rank and SIGKILLs them ``--shutdown-timeout`` seconds later (default 30); the test sets the grace
  (``GRACE``) and makes each step's rollout take longer than it (a slow reward), so the race with the SIGKILL
  is real; and the same with SIGTERM to rank 1 only (the ranks must agree);
- outside the training loop: SIGTERM (and Ctrl-C) during model loading, Lightning's setup and the step-0
  validation, each in a subprocess calling ``train()``: SystemExit code 0 before any training step, the MLflow
  run KILLED, and one line naming the command that continues it;
- checkpoint writes cut short (an exception mid-write, and SIGKILL mid-write in a subprocess) leave the previous
  checkpoint intact; keep-last-k.
Leaves out: exact resume after kill -9 (test_resume.py) and pasting the continue command
(test_continue_command.py).
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
from mlflow.tracking import MlflowClient
from test_resume import ARGS, last_train_step, start_run

from conftest import REPO, SMALL
from fspo.rewards.base import RewardOutput
from fspo.runtime.checkpoints import stop_signal
from fspo.runtime.checkpoints.checkpointing import StepCheckpoint
from fspo.runtime.checkpoints.files import list_checkpoints, load_checkpoint, read_resume_meta
from fspo.runtime.checkpoints.integrity import verify
from fspo.runtime.checkpoints.resume import scan_checkpoints

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
        # after step 2's rollout (a signal during it abandons the step: the reward test below), or before validation
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
    assert scan_checkpoints(tmp_path)[0] == ck / "step_000002.ckpt"
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
    assert scan_checkpoints(tmp_path)[0] == ck / "step_000002.ckpt"


STEPS = 3
REWARD_STOP_ARGS = ["model.source=random", f"steps={STEPS}", "prompts_per_step=4", "rollout.sampling.n=4",
        "ppo.mini_batch_size=8", "ppo.mini_batch_unit=sequences", "ppo.lr=5e-4", "rollout.sampling.max_new_tokens=16",
        "val.size=0",
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
        return compose_config([*REWARD_STOP_ARGS, *extra], output_dir=tmp_path / name, tracking_uri=mlflow_uri,
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


GRACE = 8  # torchrun --shutdown-timeout: seconds between the forwarded SIGTERM and the SIGKILL
SLOW = 12.0  # seconds the reward sleeps per step from step 2 on: a step in progress outlasts the grace


class SlowReward:
    """score = fraction of digit characters; sleeps ``SLOW`` s per call from the second training call on
    (after writing ``<cwd>/reward_<rank>.<n>``), so the test can signal while a step is in progress."""

    def __init__(self, **_):
        self.calls = 0

    def __call__(self, completions, references, lengths, overlong, max_new_tokens) -> RewardOutput:
        self.calls += 1
        Path(f"reward_{os.environ.get('RANK', '0')}.{self.calls}").touch()
        if self.calls >= 2 and len(completions) > 4 and not Path("fast").exists():  # training batches only
            time.sleep(SLOW)
        s = [sum(c.isdigit() for c in t) / max(len(t), 1) for t in completions]
        return RewardOutput(scores=s, components={"digits": s})


FSDP_ARGS = ["trainer=fsdp", "model.source=random", f"steps={STEPS}", "prompts_per_step=4", "rollout.sampling.n=4",
        "ppo.mini_batch_size=8", "ppo.mini_batch_unit=sequences", "rollout.sampling.max_new_tokens=16", "val.size=0",
        "checkpoint.every_n_steps=0",
        "seed=7", f"reward._target_={__name__}.SlowReward"]


def launch(tmp: Path, name: str, extra=()) -> subprocess.Popen:
    """torchrun (2 gloo ranks, grace ``GRACE``) of experiments/run.py in its own session; log ``tmp/name.log``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "HYDRA_FULL_ERROR": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), str(REPO), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           f"--shutdown-timeout={GRACE}", str(REPO / "experiments" / "run.py"), *FSDP_ARGS,
           f"hydra.run.dir={tmp / 'run'}", f"logger.tracking_uri=sqlite:///{tmp / 'run.db'}",
           f"+logger.artifact_location={tmp / 'artifacts'}", *extra]
    log = open(tmp / f"{name}.log", "w")
    return subprocess.Popen(cmd, cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def descendants(pid: int):
    """Pids of every live process below ``pid`` (from /proc)."""
    kids = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                stat = (p / "stat").read_text()
                kids.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(p.name))
            except (OSError, IndexError, ValueError):
                pass
    out, todo = [], [pid]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.append(k)
            todo.append(k)
    return out


def rank_pid(pids, rank: int) -> int:
    """The pid among ``pids`` whose environment has ``RANK=rank``."""
    for p in pids:
        try:
            if f"RANK={rank}".encode() in (Path(f"/proc/{p}/environ").read_bytes().split(b"\0")):
                return p
        except OSError:
            pass
    raise AssertionError(f"no process of rank {rank} among {pids}")


@pytest.mark.slow
@pytest.mark.parametrize("target", ["launcher", "rank1"])
def test_sigterm_to_torchrun_launcher_saves_and_resumes(tmp_path, target):
    """``launcher``: the scheduler's SIGTERM, forwarded by torchrun to both ranks. ``rank1``: only rank 1 gets
    it (a rank that sees the signal late, or never): rank 0 finishes its reward and follows rank 1's decision."""
    run = launch(tmp_path, "first")
    deadline = time.monotonic() + 240
    try:  # step 1 logged and step 2's slow reward running on both ranks
        while not (last_train_step(tmp_path / "run.db") >= 0 and all((tmp_path / f"reward_{r}.2").exists()
                                                                     for r in (0, 1))):
            assert run.poll() is None and time.monotonic() < deadline, (tmp_path / "first.log").read_text()[-4000:]
            time.sleep(0.05)
        ranks = descendants(run.pid)
        t0 = time.monotonic()
        # the launcher only, as a scheduler's preemption does; or one rank only
        os.kill(run.pid if target == "launcher" else rank_pid(ranks, 1), signal.SIGTERM)
        rc = run.wait(timeout=GRACE + 60)
        took = time.monotonic() - t0
        print(f"{target}: launcher exited {took:.2f} s after SIGTERM (exit {rc}, grace {GRACE} s, reward {SLOW} s)")
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    log = (tmp_path / "first.log").read_text()
    alive = [p for p in ranks if Path(f"/proc/{p}").exists() and "zombie" not in
             Path(f"/proc/{p}/status").read_text().lower()]
    for p in alive:  # leave nothing behind, then fail
        os.kill(p, signal.SIGKILL)
    assert not alive, f"rank processes left alive: {alive}"
    assert took < GRACE + 30, f"the launcher took {took:.1f} s to exit"
    ckpts = list_checkpoints(tmp_path / "run" / "checkpoints")
    assert ckpts, f"no checkpoint after SIGTERM to the launcher (exit {rc}, {took:.1f} s):\n{log[-4000:]}"
    ck = ckpts[-1]
    step = int(ck.stem.split("_")[1])
    assert verify(ck), f"{ck} does not match its manifest"
    state, loaded_step = load_checkpoint(ck)  # complete and loadable (a folder of per-rank shards)
    assert state and loaded_step == step == read_resume_meta(ck)["rl_step"]
    assert 1 <= step < STEPS and last_train_step(tmp_path / "run.db") == step - 1  # nothing logged past it
    assert "the step is abandoned" in log and "Unable to shutdown" not in log  # saved within the grace
    assert rc == 0 or target == "launcher"  # a signalled launcher re-raises the signal; the ranks exit 0
    (tmp_path / "fast").touch()
    again = launch(tmp_path, "second", ["resume=auto"])
    assert again.wait(timeout=300) == 0, (tmp_path / "second.log").read_text()[-4000:]
    assert [p.name for p in list_checkpoints(tmp_path / "run" / "checkpoints")][-1] == f"step_{STEPS:06d}.ckpt"
    assert last_train_step(tmp_path / "run.db") == STEPS - 1


@pytest.mark.slow  # > 2.5 s: out of the quick loop, still in CI
@pytest.mark.parametrize("stage, sig", [("load", "SIGTERM"), ("setup", "SIGTERM"), ("validation", "SIGTERM"),
                                        ("validation", "SIGINT")])
def test_a_stop_signal_before_training_stops_at_once(compose_cfg, mlflow_uri, monkeypatch, caplog, capfd, stage,
                                                    sig):
    """The signal is sent to this process from inside model loading, Lightning's setup or the step-0
    validation; ``train()`` must end in SystemExit(0) (the process's exit code) before any training step.
    Each case has its own experiment in the session's MLflow store."""
    import fspo.train as T
    from fspo.update.module import RLModule

    experiment = f"stop_before_training_{stage}_{sig}"
    cfg = compose_cfg([a for a in SMALL if not a.startswith("steps=")]
                      + ["steps=6", f"logger.experiment_name={experiment}"])
    out_dir = Path(cfg.output_dir)

    def kill():
        os.kill(os.getpid(), getattr(signal, sig))

    if stage == "load":
        real_load = T.load_policy

        def load(*a, **k):
            kill()
            return real_load(*a, **k)
        monkeypatch.setattr(T, "load_policy", load)
    elif stage == "setup":
        real_setup = RLModule.setup

        def setup(self, stage=None):
            kill()
            return real_setup(self, stage)
        monkeypatch.setattr(RLModule, "setup", setup)
    else:
        real_val = RLModule.validation_step

        def validation_step(self, *a, **k):
            if self.trainer.state.fn == "validate":
                kill()
            return real_val(self, *a, **k)
        monkeypatch.setattr(RLModule, "validation_step", validation_step)
    caplog.set_level("WARNING")
    with pytest.raises(SystemExit) as e:
        T.train(cfg)
    assert e.value.code in (None, 0)
    out, err = capfd.readouterr()
    log = caplog.text + out + err
    lines = {x.strip() for x in log.splitlines() if "continue with:" in x}
    assert lines and all(f"stopped on {sig} before the first training step" in x for x in lines), log[-3000:]
    assert all(f"{out_dir} resume=auto" in x for x in lines), lines
    client = MlflowClient(mlflow_uri)
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id]) if exp is not None else []
    assert [r.info.status for r in runs] == ["KILLED"] or (stage == "load" and not runs), runs
    assert all(client.get_metric_history(r.info.run_id, "train/loss") == [] for r in runs)
    assert not list(out_dir.glob("checkpoints/*.ckpt"))
