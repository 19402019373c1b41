"""SIGTERM to the torchrun launcher (not to the ranks) during a 2-rank gloo run of `experiments/run.py trainer=fsdp`.

Owns: the end-to-end check that a preempted torchrun job (SLURM, Kubernetes and schedulers signal the
launcher) leaves a complete, loadable checkpoint, exits within the launcher's grace, leaves no rank alive,
and that ``resume=auto`` on the same folder completes the run. torchrun's agent forwards the SIGTERM to every
rank and SIGKILLs them ``--shutdown-timeout`` seconds later (default 30); this test sets the grace explicitly
(``GRACE``) and makes each step's rollout take longer than it (a slow reward), so the race with the SIGKILL
is real; and the same with SIGTERM to rank 1 only (the ranks must agree). Leaves out: the single-process path (test_signals.py) and exact resume (test_resume.py).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_resume import last_train_step

from conftest import REPO
from fspo.rewards.base import RewardOutput
from fspo.runtime.checkpoints.files import list_checkpoints, load_checkpoint, read_resume_meta
from fspo.runtime.checkpoints.integrity import verify

GRACE = 8  # torchrun --shutdown-timeout: seconds between the forwarded SIGTERM and the SIGKILL
SLOW = 12.0  # seconds the reward sleeps per step from step 2 on: a step in progress outlasts the grace
STEPS = 3


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


ARGS = ["trainer=fsdp", "model.source=random", f"steps={STEPS}", "prompts_per_step=4", "rollout.sampling.n=4",
        "ppo.mini_batch_size=8", "ppo.mini_batch_unit=sequences", "rollout.sampling.max_new_tokens=16", "val.size=0", "checkpoint.every_n_steps=0",
        "seed=7", f"reward._target_={__name__}.SlowReward"]


def launch(tmp: Path, name: str, extra=()) -> subprocess.Popen:
    """torchrun (2 gloo ranks, grace ``GRACE``) of experiments/run.py in its own session; log ``tmp/name.log``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "HYDRA_FULL_ERROR": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), str(REPO), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           f"--shutdown-timeout={GRACE}", str(REPO / "experiments" / "run.py"), *ARGS,
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
