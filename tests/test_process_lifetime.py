"""No process outlives its run, no wait lasts forever.

Owns: the end-to-end kill -9 of a real ``rollout.overlap.enable=true`` run (experiments/run.py in its own
session, SIGKILLed once its engine answered; every process of the session must be gone within seconds),
`die_with_parent` on a bare child, a SIGSTOPped engine (the wait ends after ``timeout_s`` with
`EngineUnresponsive`, the child killed), and SIGTERM to a trainer waiting on a stopped engine (checkpoint,
exit 0, and resume=auto finishes the run). Leaves out: the pipeline's maths (test_rollout_overlap.py).
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

from conftest import REPO, SMALL


def session_pids(sid: int) -> list:
    """Live (not zombie) processes whose session id is ``sid``."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # state ppid pgrp session ...
        if int(fields[3]) == sid and fields[0] != "Z":
            out.append(int(d.name))
    return out


def _cmdline(pid: int) -> str:
    try:
        return f"{pid}: " + Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
    except OSError:
        return f"{pid}: gone"


def wait_gone(sid: int, within_s: float) -> list:
    deadline = time.monotonic() + within_s
    while (alive := session_pids(sid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive


def test_child_dies_with_its_parent(tmp_path):
    """A grandchild that called die_with_parent(parent) ends when its parent is SIGKILLed."""
    code = ("import multiprocessing as mp, os, time\n"
            "from fspo.rollout.async_engine import die_with_parent\n"
            "def child(ppid):\n    die_with_parent(ppid)\n    time.sleep(300)\n"
            "if __name__ == '__main__':\n"
            "    p = mp.get_context('spawn').Process(target=child, args=(os.getpid(),)); p.start()\n"
            "    print(p.pid, flush=True); time.sleep(300)\n")
    f = tmp_path / "parent.py"
    f.write_text(code)
    parent = subprocess.Popen([sys.executable, str(f)], env={**os.environ, "PYTHONPATH": str(REPO)},
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    child = int(parent.stdout.readline())
    time.sleep(1.0)
    parent.kill()
    parent.wait()
    assert wait_gone(parent.pid, 10) == [], f"child {child} outlived its parent"


@pytest.mark.slow
def test_kill_9_of_an_overlap_trainer_leaves_no_process_alive(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1"}
    args = [o for o in SMALL if not o.startswith("steps")] + ["steps=50", "val.size=0", "rollout.overlap.enable=true",
                                                               "ppo.old_log_probs=engine"]
    log = open(tmp_path / "run.log", "w")
    proc = subprocess.Popen([sys.executable, str(REPO / "experiments" / "run.py"), *args,
                             f"output_dir={tmp_path / 'out'}", f"logger.tracking_uri=sqlite:///{tmp_path}/m.db",
                             f"hydra.run.dir={tmp_path / 'h'}"], cwd=tmp_path, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 400
        while last_train_step(tmp_path / "m.db") < 0 and time.monotonic() < deadline:  # the engine answered
            assert proc.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
            time.sleep(0.5)
        assert len(session_pids(proc.pid)) >= 3, "the engine process never started"  # trainer, tracker, engine
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        alive = wait_gone(proc.pid, 15)
        assert alive == [], f"left alive after kill -9 of the trainer: {[_cmdline(p) for p in alive]}"
    finally:
        for pid in session_pids(proc.pid):
            os.kill(pid, signal.SIGKILL)


def _overlap_run(tmp_path, steps: int, extra=(), resume=False) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1"}
    args = [o for o in SMALL if not o.startswith("steps")] + [f"steps={steps}", "val.size=0",
                                                               "rollout.overlap.enable=true",
                                                               "ppo.old_log_probs=engine",
                                                               "checkpoint.every_n_steps=100", *extra]
    log = open(tmp_path / f"run{int(resume)}.log", "w")
    return subprocess.Popen([sys.executable, str(REPO / "experiments" / "run.py"), *args,
                             f"output_dir={tmp_path / 'out'}", f"logger.tracking_uri=sqlite:///{tmp_path}/m.db",
                             f"hydra.run.dir={tmp_path / 'h'}", *(["resume=auto"] if resume else [])],
                            cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _engine_pid(sid: int) -> int:
    return next(p for p in session_pids(sid) if "spawn_main" in _cmdline(p))


@pytest.mark.slow  # > 2.5 s: out of the quick loop (-m "not slow"), still in CI
def test_a_stopped_engine_ends_the_wait_with_a_clear_error():
    from fspo.models.tiny import build_tiny_model, build_tokenizer
    from fspo.rollout.async_engine import AsyncEngine, EngineUnresponsive
    from fspo.rollout.base import SamplingConfig
    from fspo.rollout.hf import HFEngine

    eng = AsyncEngine(HFEngine(batch_size=4), slots=1)
    model = build_tiny_model(seed=0)
    eng.start(model, build_tokenizer())
    eng.timeout_s = 3  # after the start: building the child's model takes longer on a loaded machine
    try:
        pid = eng.proc.pid
        os.kill(pid, signal.SIGSTOP)
        eng.push(model, 0)
        eng.submit(0, [[5, 6, 7]], SamplingConfig(n=1, max_new_tokens=4, seed=0))
        t0 = time.monotonic()
        with pytest.raises(EngineUnresponsive, match=rf"pid {pid}\) sent nothing for 3 s.*resume=auto"):
            eng.result()
        assert time.monotonic() - t0 < 20
        assert eng.proc is None and wait_gone_pid(pid, 10)
    finally:
        eng.close()


def wait_gone_pid(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.2)
    return False


@pytest.mark.slow
def test_sigterm_while_waiting_on_a_stopped_engine_checkpoints_and_exits_0(tmp_path):
    from fspo.runtime.checkpoints.files import list_checkpoints

    proc = _overlap_run(tmp_path, steps=6)
    try:
        deadline = time.monotonic() + 400
        while last_train_step(tmp_path / "m.db") < 1 and time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "run0.log").read_text()[-3000:]
            time.sleep(0.3)
        os.kill(_engine_pid(proc.pid), signal.SIGSTOP)  # the trainer now waits on an engine that never answers
        time.sleep(2)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=120)
        assert rc == 0, (tmp_path / "run0.log").read_text()[-3000:]
        ckpts = list_checkpoints(tmp_path / "out" / "checkpoints")
        assert ckpts, (tmp_path / "run0.log").read_text()[-3000:]
        assert wait_gone(proc.pid, 15) == []
    finally:
        for pid in session_pids(proc.pid):
            os.kill(pid, signal.SIGKILL)
    again = _overlap_run(tmp_path, steps=6, resume=True)
    assert again.wait(timeout=600) == 0, (tmp_path / "run1.log").read_text()[-3000:]
    assert last_train_step(tmp_path / "m.db") == 5
