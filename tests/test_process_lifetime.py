"""No process outlives its run (issue 33, item 8): kill -9 of a trainer with ``rollout.overlap.enable=true``
leaves none of its process tree alive.

Owns: the end-to-end kill of a real overlap run (experiments/run.py in its own session, SIGKILLed once its
engine process is up; every process of the session must be gone within seconds) and `die_with_parent`
on a bare child. Leaves out: the pipeline's maths and resume (test_rollout_overlap.py).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, SMALL
from test_resume import last_train_step


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
