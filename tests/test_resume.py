"""Resume after kill -9: identical parameters, identical per-step metrics, one continuous MLflow run.

Owns: the end-to-end kill/resume test (CPU, HF engine, seeded: one uninterrupted run in process, and
`experiments/run.py` subprocesses: one SIGKILLed at a random step after its first checkpoint and continued
with ``resume=auto`` alone in the same run folder, which restores the run's saved config; before that, an
untrusted stored target and an experiment-changing override are refused touching nothing; after it, more
steps extend the run), and fast checks of how `fspo.runtime.checkpoints.resume` picks a checkpoint and
how the datamodule resumes mid-run. Leaves out: signals and atomic writes (test_signals.py).

The reward is `DigitReward` (fraction of digits in the completion): the random tiny model never
writes a correct arithmetic answer, so the task's reward would be all zeros, the advantages zero and
the parameters frozen -- nothing to compare. Set FSPO_RESUME_SEED to replay a kill point.
"""
from __future__ import annotations

import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fspo.rewards.base import RewardOutput
from fspo.runtime.checkpoints.files import list_checkpoints

REPO = Path(__file__).resolve().parents[1]
STEPS, EVERY = 8, 2
ARGS = ["model.source=random", f"steps={STEPS}", "prompts_per_step=4", "rollout.sampling.n=4", "ppo.mini_batch_size=8",
        "ppo.mini_batch_unit=sequences", "ppo.lr=5e-4",
        "rollout.sampling.max_new_tokens=24", "val.size=8", "val.every_n_steps=3", f"checkpoint.every_n_steps={EVERY}",
        "checkpoint.keep_last=10", "seed=7", f"reward._target_={__name__}.DigitReward"]
NOISY = ("time/", "perf/")  # wall-clock metrics: present in both runs, values differ


class DigitReward:
    """score = fraction of digit characters in the completion (varies across samples of a random model)."""

    def __init__(self, **_):
        pass

    def __call__(self, completions, references, lengths, overlong, max_new_tokens) -> RewardOutput:
        s = [sum(c.isdigit() for c in t) / max(len(t), 1) for t in completions]
        return RewardOutput(scores=s, components={"digits": s})


def start_run(tmp: Path, name: str, extra=(), args=ARGS, full_error: bool = True) -> subprocess.Popen:
    """`experiments/run.py` with ``args`` + ``extra``, run folder ``tmp/name``, MLflow store ``tmp/name.db``; with
    ``full_error`` (HYDRA_FULL_ERROR=1) an error shows its traceback, else the one line a user sees."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), str(REPO), os.environ.get("PYTHONPATH", "")])}
    if not full_error:
        env.pop("HYDRA_FULL_ERROR")
    cmd = [sys.executable, str(REPO / "experiments" / "run.py"), *args, f"hydra.run.dir={tmp / name}",
           f"logger.tracking_uri=sqlite:///{tmp / name}.db", f"+logger.artifact_location={tmp / 'artifacts'}", *extra]
    log = open(tmp / f"{name}.{len(list(tmp.glob(name + '.*.log')))}.log", "w")
    return subprocess.Popen(cmd, cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT)


def reference_run(tmp: Path, name: str, args=ARGS) -> None:
    """The uninterrupted reference: `fspo.train.train` in this process, as experiments/run.py calls it, with
    ``args``, folder ``tmp/name`` and store ``tmp/name.db`` (what `start_run` launches, without a second
    interpreter's imports)."""
    from conftest import compose_config
    from fspo.train import train

    train(compose_config(args, output_dir=tmp / name, tracking_uri=f"sqlite:///{tmp / name}.db",
                         artifact_location=tmp / "artifacts"), overrides=list(args))


def metric_rows(db: Path):
    """[(run_uuid, key, step, value)] of every metric in an MLflow SQLite store."""
    with sqlite3.connect(db, timeout=30) as con:
        return con.execute("SELECT run_uuid, key, step, value FROM metrics").fetchall()


def last_train_step(db: Path) -> int:
    """Largest step with ``train/loss`` logged so far (-1 when none or the store is not ready)."""
    try:
        with sqlite3.connect(db, timeout=5) as con:
            row = con.execute("SELECT max(step) FROM metrics WHERE key='train/loss'").fetchone()
        return -1 if row[0] is None else int(row[0])
    except sqlite3.Error:
        return -1


def wait(proc: subprocess.Popen, tmp: Path, timeout: float = 400) -> None:
    """Wait for ``proc``; fail with the tail of every run log in ``tmp`` unless it exits 0."""
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    logs = "\n".join(p.read_text()[-3000:] for p in sorted(tmp.glob("*.log")))
    assert rc == 0, f"run failed (exit {rc}):\n{logs}"


def kill_after_step(run: subprocess.Popen, out: Path, db: Path, step: int, why: str, timeout: float = 300) -> None:
    """SIGKILL ``run`` (run folder ``out``, MLflow store ``db``) once it has logged step ``step``'s train
    metrics and written a checkpoint."""
    deadline = time.monotonic() + timeout
    while last_train_step(db) < step or not list_checkpoints(out / "checkpoints"):
        assert run.poll() is None, f"{why}: the run ended before it was killed"
        assert time.monotonic() < deadline, why
        time.sleep(0.05)
    os.kill(run.pid, signal.SIGKILL)
    run.wait()


def policy_state(ckpt: Path):
    """The ``policy.*`` tensors of a checkpoint file."""
    sd = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
    return {k: v for k, v in sd.items() if k.startswith("policy.")}


def run_to_end(tmp: Path, name: str, extra=(), args=ARGS, timeout: float = 400):
    """`start_run` waited for, errors as the one line a user sees: (exit code, that launch's log text)."""
    log = tmp / f"{name}.{len(list(tmp.glob(name + '.*.log')))}.log"
    proc = start_run(tmp, name, extra, args, full_error=False)
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return rc, log.read_text()


@pytest.mark.slow
def test_kill9_then_resume_auto_alone_matches_uninterrupted_run(tmp_path):
    """kill -9 at a random step, then ``resume=auto`` alone (plus the folder and store): the saved config is
    the run's, so the continued run equals the uninterrupted one, parameters and every metric. Before that,
    two refusals touch nothing: the stored reward target (this module's class, not fspo's) is instantiated only
    when the command line names it again, and an override that changes the experiment is refused. After it,
    an allowed change (more steps) extends the run and is recorded in MLflow."""
    seed = int(os.environ.get("FSPO_RESUME_SEED", time.time_ns() % 10_000))
    rng = random.Random(seed)
    # kill as soon as the train metrics of step k are logged: for even k the newest checkpoint is
    # step_k (written before step k ran), so the resumed run computes step k again and must not log it
    # twice; for odd k the kill tends to land while step_(k+1).ckpt is being written
    kill_after = rng.randint(EVERY, STEPS - 2)
    why = f"FSPO_RESUME_SEED={seed}: killed after step {kill_after}"

    run = start_run(tmp_path, "killed")
    db, out = tmp_path / "killed.db", tmp_path / "killed"
    kill_after_step(run, out, db, kill_after, why)
    run_id = (out / "mlflow_run_id").read_text().strip()
    done = list_checkpoints(out / "checkpoints")
    assert done and int(done[-1].stem.split("_")[1]) < STEPS, why
    why += f", logged up to step {last_train_step(db)}, resumed from {done[-1].name}"
    rows = metric_rows(db)

    # refused, nothing touched: an untrusted stored target, then a change of the experiment
    rc, log = run_to_end(tmp_path, "killed", ["resume=auto"], args=[])
    assert rc == 2 and log.strip().splitlines()[-1].startswith("error: UntrustedTarget: reward._target_="), log[-3000:]
    assert metric_rows(db) == rows and list_checkpoints(out / "checkpoints") == done
    trust = [a for a in ARGS if a.startswith("reward._target_=")]
    rc, log = run_to_end(tmp_path, "killed", ["resume=auto", "prompts_per_step=16", "seed=5", "steps=10", *trust],
                         args=[])
    assert rc == 2, log[-3000:]
    last = log.strip().splitlines()[-1]
    assert last.startswith("error: ConfigChangedOnResume: resume: this command line changes the run's saved config")
    assert "prompts_per_step 4 -> 16" in last and "seed 7 -> 5" in last and "steps 8 -> 10" not in last
    assert metric_rows(db) == rows and list_checkpoints(out / "checkpoints") == done

    resumed = start_run(tmp_path, "killed", ["resume=auto", *trust], args=[])
    reference_run(tmp_path, "full")  # meanwhile
    wait(resumed, tmp_path)

    # parameters: equal to the uninterrupted run's
    a, b = policy_state(tmp_path / "full" / "checkpoints" / f"step_{STEPS:06d}.ckpt"), \
        policy_state(out / "checkpoints" / f"step_{STEPS:06d}.ckpt")
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert diff <= 1e-6, f"{why}: max |param diff| {diff}"
    assert max(float((a[k] - policy_state(done[0])[k]).abs().max()) for k in a) > 1e-3  # it did learn

    # MLflow: one run, same id, one value per (metric, step), same steps and values as the reference
    rows, ref = metric_rows(db), metric_rows(tmp_path / "full.db")
    assert {r[0] for r in rows} == {run_id}, why
    pairs = [(k, s) for _, k, s, _ in rows]
    dupes = sorted({p for p in pairs if pairs.count(p) > 1})
    assert not dupes, f"{why}: duplicated steps {dupes[:10]}"
    got, want = {(k, s): v for _, k, s, v in rows}, {(k, s): v for _, k, s, v in ref}
    assert set(got) == set(want), f"{why}: missing {sorted(set(want) - set(got))[:10]}, " \
                                  f"extra {sorted(set(got) - set(want))[:10]}"
    bad = {p: (got[p], want[p]) for p in want if not p[0].startswith(NOISY)
           and abs(got[p] - want[p]) > 1e-6 * max(1.0, abs(want[p]))}
    assert not bad, f"{why}: metrics differ {dict(list(bad.items())[:10])}"
    assert {s for k, s in want if k == "train/loss"} == set(range(STEPS))
    # the saved config was the one continued: its batch, its validation schedule, its last step
    assert {s: v for (k, s), v in got.items() if k == "train/updates"} == {s: 2.0 for s in range(STEPS)}
    assert sorted(s for k, s in got if k == "val/accuracy") == [0, 3, 6, 8]  # val.every_n_steps=3, steps=8
    with sqlite3.connect(db) as con:
        assert con.execute("SELECT status FROM runs WHERE run_uuid=?", (run_id,)).fetchone()[0] == "FINISHED"
        params = dict(con.execute("SELECT key, value FROM params WHERE run_uuid=?", (run_id,)).fetchall())
    assert (params["steps"], params["prompts_per_step"], params["val/size"]) == (str(STEPS), "4", "8")

    rc, log = run_to_end(tmp_path, "killed", ["resume=auto", "steps=9", *trust], args=[])  # allowed: recorded
    assert rc == 0, log[-3000:]
    with sqlite3.connect(db) as con:
        tags = dict(con.execute("SELECT key, value FROM tags WHERE run_uuid=?", (run_id,)).fetchall())
    assert tags["fspo.resume.step_8.steps"] == "8 -> 9"
    assert [p.name for p in list_checkpoints(out / "checkpoints")][-1] == "step_000009.ckpt"


# ------------------------------------------------------------------ fast checks
def _fake_ckpt(path: Path, step: int, run_id: str = "abc") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": {}, "fspo_resume": {"rl_step": step, "mlflow_run_id": run_id}}, path)


def test_resolve_resume_picks_newest_complete_checkpoint(tmp_path):
    from omegaconf import OmegaConf

    from fspo.runtime.checkpoints.resume import resolve_resume

    ck = tmp_path / "checkpoints"
    assert resolve_resume(OmegaConf.create({"resume": None}), tmp_path).ckpt_path is None
    assert not resolve_resume(OmegaConf.create({"resume": "auto"}), tmp_path).resuming
    for s in (2, 4, 10):
        _fake_ckpt(ck / f"step_{s:06d}.ckpt", s, run_id=f"r{s}")
    (ck / "step_000012.ckpt.partial").write_bytes(b"half a checkpoint")  # a write cut short: ignored
    (ck / "step_000010.ckpt").write_bytes(b"not a zip")  # damaged: skipped, the previous one is used
    plan = resolve_resume(OmegaConf.create({"resume": "auto"}), tmp_path)
    assert (Path(plan.ckpt_path).name, plan.step, plan.run_id) == ("step_000004.ckpt", 4, "r4")
    plan = resolve_resume(OmegaConf.create({"resume": str(ck / "step_000002.ckpt")}), tmp_path)
    assert (plan.step, plan.run_id) == (2, "r2")
    with pytest.raises(ValueError, match="resume=auto"):  # would mix two runs' checkpoints
        resolve_resume(OmegaConf.create({"resume": None}), tmp_path)
    with pytest.raises(FileNotFoundError, match="no such checkpoint"):
        resolve_resume(OmegaConf.create({"resume": str(ck / "nope.ckpt")}), tmp_path)


def test_datamodule_resumes_from_the_sampler_position():
    """The sampler position is authoritative: after load_state_dict the loader yields the remaining steps'
    prompts, while its length stays the whole run (Lightning's restored progress counts the rest)."""
    from fspo.data.arithmetic import ArithmeticTask
    from fspo.data.datamodule import PromptDataModule

    src = ArithmeticTask(size=40, seed=0)
    ref = [b["index"].tolist() for b in PromptDataModule(src, prompts_per_step=3, steps=6, seed=1).train_dataloader()]
    dm = PromptDataModule(src, prompts_per_step=3, steps=6, seed=1)
    dm.load_state_dict({"sampler": {"position": 4}})
    loader = dm.train_dataloader()
    assert len(loader) == 6 and loader.state_dict() == {"position": 4}
    assert [b["index"].tolist() for b in loader] == ref[4:]
    assert dm.state_dict() == {"sampler": {"position": 6}}


def test_continued_run_logs_each_step_once(compose_cfg):
    """Steps the killed attempt logged at or after the checkpoint keep their first value, through both
    the logger and the client's log_metric; params already logged are not logged again."""
    from fspo.runtime.checkpoints.resume import ResumePlan
    from fspo.tracking.logger import build_logger, log_params_once

    cfg = compose_cfg([])
    [first] = build_logger(cfg, {}, cfg.output_dir, ResumePlan())  # the list of the run's loggers: MLflow only
    log_params_once(first, {"seed": "1", "resume": "None"})
    for s in range(4):
        first.log_metrics({"train/loss": float(s)}, step=s)
    first.experiment.log_metric(first.run_id, "run/x", 1.0, step=3)
    [again] = build_logger(cfg, {}, cfg.output_dir, ResumePlan(ckpt_path="x", step=2, run_id=first.run_id))
    log_params_once(again, {"seed": "1", "resume": "auto", "new": "y"})  # no error on the changed value
    for s in range(2, 6):
        again.log_metrics({"train/loss": 10.0 + s}, step=s)
    again.experiment.log_metric(again.run_id, "run/x", 2.0, step=3)
    client = again.experiment
    hist = sorted((m.step, m.value) for m in client.get_metric_history(first.run_id, "train/loss"))
    assert hist == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0), (4, 14.0), (5, 15.0)]
    assert [m.value for m in client.get_metric_history(first.run_id, "run/x")] == [1.0]
    run = client.get_run(first.run_id)
    assert run.info.status == "RUNNING" and run.data.params == {"seed": "1", "resume": "None", "new": "y"}
