"""Runs that never lose work: one run per output folder, damaged checkpoints
detected and moved aside, no silent fresh start, and a resumed run keeps its own config.

Owns: the output-folder lock (fspo/runtime/checks/run_lock.py: a second run exits at once naming the holder; a
killed holder's lock is taken over), checkpoint checksums (fspo/runtime/checkpoints/integrity.py) and how
`fspo.runtime.checkpoints.resume.resolve_resume` uses them (newest good checkpoint; all damaged: an error, nothing
touched; ``resume=fresh``; older checkpoints without manifest load unverified), the non-finite guard
after loading, and the resumed config (fspo/runtime/checks/run_config.py: saved config restored, experiment-changing
overrides refused, allowed ones recorded; end to end, a resume with ``resume=auto`` alone is checked in
test_resume.py's kill -9 test). The end-to-end cases run `experiments/run.py` as subprocesses on the tiny model
(functions from test_resume.py). Leaves out: kill -9 / exact resume (test_resume.py) and signals (test_signals.py).
"""
from __future__ import annotations

import json
import os
import signal
import sqlite3
import struct
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from test_resume import ARGS, REPO, policy_state

from fspo.runtime.checkpoints.files import list_checkpoints
from fspo.runtime.checkpoints.integrity import CheckpointCorrupt, manifest_path, quarantine, verify, write_manifest
from fspo.runtime.checkpoints.resume import ResumePlan, resolve_resume
from fspo.runtime.checks.run_config import RUN_CONFIG_FILE, ConfigChangedOnResume, resume_config
from fspo.runtime.checks.run_lock import LOCK_FILE, OutputDirInUse, acquire, hold_output_dir, release

# small runs: 4 prompts x 4 samples, 24 new tokens, 4 validation prompts (seconds per step on a CPU)
BASE = [a for a in ARGS if not a.startswith(("steps=", "checkpoint.", "val.", "seed="))] + \
    ["val.size=4", "val.every_n_steps=3", "checkpoint.keep_last=5"]
HOLDER = """
import sys, time
from fspo.runtime.checks.run_lock import acquire
acquire(sys.argv[1]); print("locked", flush=True); time.sleep(600)
"""


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), str(REPO), os.environ.get("PYTHONPATH", "")])}


def launch(tmp: Path, run_dir: Path, log_name: str, args) -> subprocess.Popen:
    """`experiments/run.py args` with run folder ``run_dir`` and MLflow store ``tmp/mlflow.db``."""
    cmd = [sys.executable, str(REPO / "experiments" / "run.py"), *args, f"hydra.run.dir={run_dir}",
           f"logger.tracking_uri=sqlite:///{tmp / 'mlflow.db'}", f"+logger.artifact_location={tmp / 'artifacts'}"]
    return subprocess.Popen(cmd, cwd=tmp, env=_env(), stdout=open(tmp / log_name, "w"), stderr=subprocess.STDOUT)


def run(tmp: Path, run_dir: Path, log_name: str, args, timeout: float = 300):
    """Run to the end; (exit code, log text)."""
    proc = launch(tmp, run_dir, log_name, args)
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return rc, (tmp / log_name).read_text()


def run_ok(tmp: Path, run_dir: Path, log_name: str, args) -> str:
    """Run to the end, which must be exit code 0; the log text."""
    rc, log = run(tmp, run_dir, log_name, args)
    assert rc == 0, log[-3000:]
    return log


def ckpt_run_id(path: Path) -> str:
    return torch.load(path, map_location="cpu", weights_only=True)["fspo_resume"]["mlflow_run_id"]


def corrupt_weights(ckpt: Path) -> str:
    """Overwrite 4 KiB inside the stored bytes of the first large policy weight with 0xFF (float32 NaN):
    the zip stays readable, the tensor loads as NaN -- damage a plain torch.load does not notice."""
    sd = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
    key = next(k for k, v in sd.items() if k.startswith("policy.") and v.numel() >= 4096)
    want = sd[key].contiguous().numpy().tobytes()
    with zipfile.ZipFile(ckpt) as z:
        info = next(i for i in z.infolist() if "/data/" in i.filename and z.read(i.filename) == want)
    with open(ckpt, "r+b") as f:
        f.seek(info.header_offset)
        n, m = struct.unpack("<HH", f.read(30)[26:30])
        f.seek(info.header_offset + 30 + n + m + info.file_size // 4)
        f.write(b"\xff" * 4096)
    assert torch.isnan(torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"][key]).any()
    return key


# ------------------------------------------------------------------ the output-folder lock
def test_lock_refuses_a_second_holder_and_is_taken_over_after_kill9(tmp_path, caplog):
    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], env=_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(OutputDirInUse, match=rf"output_dir {out} is in use by another run \(pid {holder.pid} on "
                                                 rf"host .*started .*pass another output_dir"):
            acquire(out)
        with pytest.raises(OutputDirInUse):
            with hold_output_dir(out):
                pass
        with hold_output_dir(out, owner=False):  # ranks other than 0 take nothing
            pass
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert json.loads((out / LOCK_FILE).read_text())["pid"] == holder.pid  # the dead holder's record is left
    with caplog.at_level("WARNING"):
        with hold_output_dir(out):  # the kernel dropped the dead process's lock
            assert json.loads((out / LOCK_FILE).read_text())["pid"] == os.getpid()
            with hold_output_dir(out):  # re-entrant in one process (Hydra callback + train)
                pass
            assert acquire(out) and release(out) is None
            assert json.loads((out / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert f"pid {holder.pid}" in caplog.text and "ended without releasing its lock" in caplog.text
    assert (out / LOCK_FILE).read_text() == ""  # released cleanly: empty, nothing stale
    with pytest.raises(RuntimeError):
        with hold_output_dir(out):
            raise RuntimeError("the run failed")
    acquire(out)  # released on the exception
    release(out)


@pytest.mark.slow
def test_second_run_in_the_same_output_dir_exits_at_once_and_touches_nothing(tmp_path):
    """Two runs in one folder: seeds 1 and 2, same output_dir, a checkpoint every step."""
    out = tmp_path / "out"
    args = BASE + ["steps=4", "checkpoint.every_n_steps=1"]
    first = launch(tmp_path, out, "seed1.log", args + ["seed=1"])
    deadline = time.monotonic() + 120
    while not (out / LOCK_FILE).is_file() or not (out / LOCK_FILE).read_text().strip():
        assert first.poll() is None and time.monotonic() < deadline, (tmp_path / "seed1.log").read_text()[-3000:]
        time.sleep(0.05)
    os.kill(first.pid, signal.SIGSTOP)  # it holds the lock, but cannot finish its 4 steps while the second starts
    try:
        t0 = time.monotonic()
        rc, log = run(tmp_path, out, "seed2.log", args + ["seed=2"])
    finally:
        os.kill(first.pid, signal.SIGCONT)
    assert rc == 2 and time.monotonic() - t0 < 60, log[-3000:]
    assert f"error: OutputDirInUse: output_dir {out} is in use by another run (pid {first.pid} " in log
    assert first.wait(timeout=300) == 0, (tmp_path / "seed1.log").read_text()[-3000:]
    run_id = (out / "mlflow_run_id").read_text().strip()
    ckpts = list_checkpoints(out / "checkpoints")
    assert [p.name for p in ckpts] == [f"step_{s:06d}.ckpt" for s in range(1, 5)]
    assert {ckpt_run_id(p) for p in ckpts} == {run_id}
    assert "seed=1" in (out / ".hydra" / "overrides.yaml").read_text()  # Hydra's files are the first run's
    assert "seed=2" not in (out / "run.log").read_text()
    with sqlite3.connect(tmp_path / "mlflow.db") as con:
        runs = con.execute("SELECT r.run_uuid, r.status, p.value FROM runs r JOIN params p ON p.run_uuid = r.run_uuid "
                           "AND p.key = 'seed'").fetchall()
    assert runs == [(run_id, "FINISHED", "1")]  # the second run never reached MLflow
    assert (out / LOCK_FILE).read_text() == ""


# ------------------------------------------------------------------ checksums
def test_manifest_verifies_files_and_shard_folders(tmp_path):
    f = tmp_path / "step_000002.ckpt.partial"
    torch.save({"w": torch.arange(100.0)}, f)
    man = write_manifest(f, tmp_path / "step_000002.ckpt")
    f.rename(tmp_path / "step_000002.ckpt")
    ck = tmp_path / "step_000002.ckpt"
    assert man == manifest_path(ck) and man.read_text().endswith("  step_000002.ckpt\n")
    assert verify(ck) is True
    data = bytearray(ck.read_bytes())
    data[len(data) // 2] ^= 0xFF
    ck.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorrupt, match="does not match its SHA-256"):
        verify(ck)
    man.unlink()
    assert verify(ck) is False  # an older version's checkpoint: unverified
    d = tmp_path / "step_000004.ckpt.partial"  # a shard folder
    d.mkdir()
    for name in ("__0_0.distcp", "__1_0.distcp", "meta.pt", ".metadata"):
        (d / name).write_bytes(name.encode() * 100)
    write_manifest(d, tmp_path / "step_000004.ckpt", known={"__1_0.distcp": "0" * 64})  # rank 1's own digest
    d = d.rename(tmp_path / "step_000004.ckpt")
    with pytest.raises(CheckpointCorrupt, match="__1_0.distcp does not match"):
        verify(d)
    write_manifest(d, d)
    assert verify(d) is True
    (d / "extra").write_text("x")
    with pytest.raises(CheckpointCorrupt, match="not in"):
        verify(d)
    (d / "extra").unlink()
    (d / "meta.pt").unlink()
    with pytest.raises(CheckpointCorrupt, match="meta.pt is missing"):
        verify(d)
    moved = quarantine(d)
    assert moved == tmp_path / "damaged" / "step_000004.ckpt" and manifest_path(moved).is_file()
    (tmp_path / "step_000004.ckpt").mkdir()
    assert quarantine(tmp_path / "step_000004.ckpt").name == "step_000004.ckpt.1"  # never overwritten


def _ckpt(ck: Path, step: int, run_id: str = "r", manifest: bool = True) -> Path:
    p = ck / f"step_{step:06d}.ckpt"
    ck.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": {"w": torch.ones(64)}, "fspo_resume": {"rl_step": step, "mlflow_run_id": run_id}}, p)
    if manifest:
        write_manifest(p, p)
    return p


def _damage(p: Path) -> None:
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))


def test_resume_skips_damaged_checkpoints_and_never_deletes_one(tmp_path, caplog):
    ck = tmp_path / "checkpoints"
    old, mid, new = _ckpt(ck, 2, manifest=False), _ckpt(ck, 4), _ckpt(ck, 6)
    _damage(new)
    damaged = new.read_bytes()
    with caplog.at_level("WARNING"):
        plan = resolve_resume(OmegaConf.create({"resume": "auto"}), tmp_path)
    assert (Path(plan.ckpt_path), plan.step) == (mid, 4)
    assert (ck / "damaged" / new.name).read_bytes() == damaged and (ck / "damaged" / (new.name + ".sha256")).is_file()
    assert "skipping damaged checkpoint" in caplog.text and "moved damaged checkpoint" in caplog.text
    _damage(mid)
    caplog.clear()
    with caplog.at_level("WARNING"):
        plan = resolve_resume(OmegaConf.create({"resume": "auto"}), tmp_path)  # an older version's: unverified
    assert Path(plan.ckpt_path) == old and "step_000002.ckpt.sha256 is MISSING" in caplog.text
    with pytest.raises(CheckpointCorrupt, match="resume=.*step_000004.ckpt.*is damaged"):
        resolve_resume(OmegaConf.create({"resume": str(ck / "damaged" / mid.name)}), tmp_path)


def test_all_checkpoints_damaged_is_an_error_until_resume_fresh(tmp_path):
    ck = tmp_path / "checkpoints"
    a, b = _ckpt(ck, 2, run_id="old"), _ckpt(ck, 4, run_id="old")
    (tmp_path / "mlflow_run_id").write_text("old\n")
    _damage(a)
    b.write_bytes(b"truncated")
    before = {p.name: p.read_bytes() for p in ck.iterdir()}
    with pytest.raises(CheckpointCorrupt, match=r"resume=auto: no checkpoint in .* can be used \(step_000004.ckpt "
                                                r"does not match.*step_000002.ckpt does not match.*\); nothing was "
                                                r"changed. Pass resume=fresh"):
        resolve_resume(OmegaConf.create({"resume": "auto"}), tmp_path)
    assert {p.name: p.read_bytes() for p in ck.iterdir()} == before  # nothing moved, nothing deleted
    plan = resolve_resume(OmegaConf.create({"resume": "fresh"}), tmp_path)
    assert plan == ResumePlan() and not list_checkpoints(ck)
    assert sorted(p.name for p in (ck / "damaged").iterdir()) == sorted(before)
    _ckpt(ck, 2)
    with pytest.raises(ValueError, match="resume=fresh: .*step_000002.ckpt is a usable checkpoint"):
        resolve_resume(OmegaConf.create({"resume": "fresh"}), tmp_path)


def test_checkpoint_save_writes_manifest_and_prunes_with_it(tmp_path):
    from test_signals import FakeTrainer, good_writer

    from fspo.runtime.checkpoints.checkpointing import StepCheckpoint

    ck = tmp_path / "checkpoints"
    cb = StepCheckpoint(ck, keep_last=2)
    ck.mkdir()
    (ck / "step_000001.ckpt.sha256").write_text("orphan of a write cut short\n")
    for s in (2, 4, 6):
        cb._save(FakeTrainer(good_writer(s)), s)
    assert sorted(p.name for p in ck.iterdir()) == ["step_000004.ckpt", "step_000004.ckpt.sha256",
                                                     "step_000006.ckpt", "step_000006.ckpt.sha256"]
    assert all(verify(p) for p in list_checkpoints(ck))
    StepCheckpoint(ck, keep_last=5, checksum=False)._save(FakeTrainer(good_writer(6)), 6)
    assert verify(ck / "step_000006.ckpt") is False  # no stale manifest left for a rewritten checkpoint


@pytest.mark.slow  # > 2.5 s: out of the quick loop (-m "not slow"), still in CI
def test_nonfinite_parameters_after_loading_stop_and_move_the_checkpoint_aside(compose_cfg):
    """A checkpoint of an older version (no manifest) whose weights load as NaN: a clear error before the
    first step, the checkpoint moved to damaged/, and the next resume=auto continues from the one before."""
    from fspo.train import train

    args = BASE + ["steps=2", "checkpoint.every_n_steps=1", "val.size=0", "seed=3"]
    train(compose_cfg(args))
    ck = Path(compose_cfg(args).output_dir) / "checkpoints"
    for p in ck.glob("*.sha256"):
        p.unlink()
    key = corrupt_weights(ck / "step_000002.ckpt")
    cfg = compose_cfg([a for a in args if a != "steps=2"] + ["steps=3", "resume=auto"])
    with pytest.raises(CheckpointCorrupt, match=rf"step_000002.ckpt loaded non-finite parameters \({key}\).*"
                                                r"moved it to .*damaged/step_000002.ckpt; run again with resume=auto"):
        train(cfg)
    assert (ck / "damaged" / "step_000002.ckpt").is_file()
    train(cfg)  # from step 1
    assert [p.name for p in list_checkpoints(ck)] == ["step_000001.ckpt", "step_000002.ckpt", "step_000003.ckpt"]
    assert all(torch.isfinite(v).all() for v in policy_state(ck / "step_000003.ckpt").values())


def _in_process_cfg(tmp_path, out, args):
    """The config experiments/run.py composes from ``args``, with folder ``out`` and store ``tmp/mlflow.db``."""
    from conftest import compose_config

    return compose_config(args, output_dir=out, tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
                          artifact_location=tmp_path / "artifacts")


@pytest.mark.slow
def test_damaged_newest_checkpoint_resumes_from_the_previous_one(tmp_path, caplog, capfd):
    """A damaged checkpoint: bytes overwritten inside the newest checkpoint (loads as NaN weights). In process
    (`fspo.train.train`, as experiments/run.py calls it)."""
    from fspo.train import train

    out = tmp_path / "out"
    args = BASE + ["steps=4", "checkpoint.every_n_steps=2", "seed=3"]
    train(_in_process_cfg(tmp_path, out, args))
    newest = out / "checkpoints" / "step_000004.ckpt"
    corrupt_weights(newest)
    damaged = newest.read_bytes()
    capfd.readouterr()
    caplog.clear()
    caplog.set_level("INFO")
    train(_in_process_cfg(tmp_path, out, args[:-3] + args[-2:] + ["steps=6", "resume=auto"]))  # allowed change
    log = caplog.text + "".join(capfd.readouterr())
    assert "skipping damaged checkpoint" in log and "step_000004.ckpt does not match its SHA-256" in log, log[-3000:]
    assert f"continuing from {out / 'checkpoints' / 'step_000002.ckpt'} (step 2)" in log, log[-3000:]
    assert (out / "checkpoints" / "damaged" / "step_000004.ckpt").read_bytes() == damaged  # moved aside, intact
    ckpts = list_checkpoints(out / "checkpoints")
    assert [p.name for p in ckpts] == ["step_000002.ckpt", "step_000004.ckpt", "step_000006.ckpt"]
    assert all(verify(p) for p in ckpts)
    assert all(torch.isfinite(v).all() for v in policy_state(ckpts[-1]).values())


@pytest.mark.slow
def test_all_checkpoints_unreadable_exit_nonzero_and_keep_them(tmp_path):
    """No silent fresh start: every checkpoint truncated -> an error, not a fresh start; resume=fresh starts over.
    In process (`fspo.train.train`, as experiments/run.py calls it); the error's console line is `user_error`'s."""
    from fspo.runtime.checks.errors import user_error
    from fspo.train import train

    out = tmp_path / "out"
    args = BASE + ["steps=2", "checkpoint.every_n_steps=1", "seed=3"]

    def cfg(extra=()):
        return _in_process_cfg(tmp_path, out, [*args, *extra])

    train(cfg())
    old_run = (out / "mlflow_run_id").read_text().strip()
    for p in list_checkpoints(out / "checkpoints"):
        with open(p, "r+b") as f:
            f.truncate(1000)
    before = {p.name: p.read_bytes() for p in (out / "checkpoints").iterdir()}
    with pytest.raises(CheckpointCorrupt) as e:
        train(cfg(["resume=auto"]))
    last = user_error(e.value)
    assert last.startswith("CheckpointCorrupt: resume=auto: no checkpoint in") and "resume=fresh" in last, last
    assert "\n" not in last
    assert {p.name: p.read_bytes() for p in (out / "checkpoints").iterdir()} == before
    train(cfg(["resume=fresh"]))
    assert sorted(p.name for p in (out / "checkpoints" / "damaged").iterdir()) == sorted(before)
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == ["step_000001.ckpt", "step_000002.ckpt"]
    assert (out / "mlflow_run_id").read_text().strip() != old_run


# ------------------------------------------------------------------ the run's config on resume
def _saved(tmp_path, **over) -> OmegaConf:
    base = {"seed": 1, "steps": 30, "prompts_per_step": 8, "output_dir": str(tmp_path), "resume": None,
            "cpu_threads": 1, "val": {"size": 16, "every_n_steps": 20}, "tags": {"mlflow.parentRunId": "p"},
            "ppo": {"prompts_per_step": "${prompts_per_step}"}}
    (tmp_path / RUN_CONFIG_FILE).write_text(OmegaConf.to_yaml(OmegaConf.create(base)))
    new = OmegaConf.create({**base, "steps": 60, "prompts_per_step": 16, "val": {"size": 256, "every_n_steps": 20},
                            "resume": "auto", "new_key": 3, **over})
    OmegaConf.set_struct(new, True)
    return new


def test_resume_restores_saved_config_and_refuses_experiment_changes(tmp_path, caplog):
    plan = ResumePlan(ckpt_path=None, step=12, run_id="r")  # killed before its first checkpoint: run_config.yaml
    with caplog.at_level("INFO"):
        cfg = resume_config(_saved(tmp_path), plan, tmp_path, overrides=["resume=auto", "hydra.run.dir=x"])
    assert (cfg.steps, cfg.prompts_per_step, cfg.val.size, cfg.resume, cfg.new_key) == (30, 8, 16, "auto", 3)
    assert cfg.ppo.prompts_per_step == 8 and plan.overrides == {} and OmegaConf.is_struct(cfg)
    assert "prompts_per_step (16 -> 8)" in caplog.text
    with pytest.raises(ConfigChangedOnResume, match=r"prompts_per_step 8 -> 16; seed 1 -> 2\. A continued run keeps "
                                                    r"its batch.*drop these overrides"):
        resume_config(_saved(tmp_path, seed=2), plan, tmp_path, overrides=["resume=auto", "prompts_per_step=16",
                                                                            "+seed=2", "steps=40"])
    cfg = resume_config(_saved(tmp_path, cpu_threads=2), plan, tmp_path,
                        overrides=["resume=auto", "steps=60", "cpu_threads=2", "tags.mlflow.parentRunId=q"])
    assert (cfg.steps, cfg.prompts_per_step, cfg.cpu_threads) == (60, 8, 2)
    assert plan.overrides == {"steps": "30 -> 60", "cpu_threads": "1 -> 2"}
    assert OmegaConf.load(tmp_path / RUN_CONFIG_FILE).steps == 60  # the effective config is the saved one now
    with pytest.raises(ConfigChangedOnResume, match="steps=10 is below the checkpoint's step 12"):
        resume_config(_saved(tmp_path, steps=10), plan, tmp_path, overrides=["steps=10"])
    no_command_line = r"saved config \(.*\): prompts_per_step 8 -> 60; val.size 16 -> 256\. "  # every change counts
    with pytest.raises(ConfigChangedOnResume, match=no_command_line):
        resume_config(_saved(tmp_path, prompts_per_step=60), plan, tmp_path, overrides=None)
    (tmp_path / RUN_CONFIG_FILE).unlink()
    new = _saved(tmp_path)
    (tmp_path / RUN_CONFIG_FILE).unlink()
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert resume_config(new, plan, tmp_path, overrides=[]) is new  # an older version's run: as given
    assert "no saved config" in caplog.text
    fresh = ResumePlan()
    assert resume_config(new, fresh, tmp_path, overrides=[]) is new
    assert OmegaConf.load(tmp_path / RUN_CONFIG_FILE).steps == 60


def test_evaluation_reads_the_runs_own_config_and_skips_damaged_checkpoints(tmp_path):
    """experiments/evaluate.py: a resumed launch rewrote .hydra/config.yaml with its command line, while
    run_config.yaml is the run's; checkpoints moved to damaged/ are not evaluated."""
    from fspo.runtime.checkpoints.files import find_checkpoints, find_run_config

    ck = tmp_path / "checkpoints"
    good = _ckpt(ck, 2)
    quarantine(_ckpt(ck, 4))
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text("steps: 60\n")
    assert find_run_config(good) == tmp_path / ".hydra" / "config.yaml"
    (tmp_path / RUN_CONFIG_FILE).write_text("steps: 30\n")
    assert find_run_config(good) == tmp_path / RUN_CONFIG_FILE
    assert find_checkpoints(tmp_path) == [good.resolve()]


def test_resume_reads_a_config_saved_before_the_regrouping(tmp_path):
    """A run saved when the classes lived in flat modules (``fspo.module.PPOConfig``,
    ``fspo.guard.DivergenceGuard``, ``fspo.distributed.FSDP2Strategy``) resumes: the saved targets are
    read as the new paths, which is not a change of the experiment."""
    from fspo.runtime.checks.run_config import LEGACY_TARGETS, upgrade_legacy_targets

    old = {"seed": 1, "steps": 30, "output_dir": str(tmp_path), "resume": None,
           "ppo": {"_target_": "fspo.module.PPOConfig", "lr": 1e-6},
           "guard": {"_target_": "fspo.guard.DivergenceGuard", "action": "stop"},
           "trainer": {"strategy": {"_target_": "fspo.distributed.FSDP2Strategy"}},
           "callbacks": [{"_target_": "fspo.run_lock.LockOutputDir"}]}
    (tmp_path / RUN_CONFIG_FILE).write_text(OmegaConf.to_yaml(OmegaConf.create(old)))
    new = OmegaConf.create({**old, "resume": "auto",
                            "ppo": {"_target_": "fspo.update.settings.PPOConfig", "lr": 1e-6},
                            "guard": {"_target_": "fspo.update.guard.DivergenceGuard", "action": "stop"},
                            "trainer": {"strategy": {"_target_": "fspo.runtime.launch.distributed.FSDP2Strategy"}},
                            "callbacks": [{"_target_": "fspo.runtime.checks.run_lock.LockOutputDir"}]})
    cfg = resume_config(new, ResumePlan(ckpt_path=None, step=3, run_id="r"), tmp_path, overrides=["resume=auto"])
    assert cfg.ppo._target_ == "fspo.update.settings.PPOConfig"
    assert cfg.guard._target_ == "fspo.update.guard.DivergenceGuard"
    assert cfg.trainer.strategy._target_ == "fspo.runtime.launch.distributed.FSDP2Strategy"
    assert cfg.callbacks[0]._target_ == "fspo.runtime.checks.run_lock.LockOutputDir"
    # every new path the map names exists
    import importlib
    for new_path in LEGACY_TARGETS.values():
        mod, name = new_path.rsplit(".", 1)
        assert hasattr(importlib.import_module(mod), name), new_path
    untouched = OmegaConf.create({"clip": {"_target_": "fspo.clipping.fspo.FSPOClip"}})
    assert upgrade_legacy_targets(untouched) == 0 and untouched.clip._target_ == "fspo.clipping.fspo.FSPOClip"


def test_resume_of_another_method_does_not_take_the_default_methods_keys(tmp_path):
    """A run started with +method=sapo, resumed with only resume=auto: the command line composes the
    default method (FSPO's clip, with ``alpha``); the saved SAPO clip is restored and FSPO's extra keys
    are not added to it as if they were new settings (they made SAPOClip fail on ``alpha``)."""
    saved = {"seed": 1, "steps": 30, "output_dir": str(tmp_path), "resume": None, "method": "sapo",
             "clip": {"_target_": "fspo.clipping.sapo.SAPOClip", "tau_pos": 1.0}}
    (tmp_path / RUN_CONFIG_FILE).write_text(OmegaConf.to_yaml(OmegaConf.create(saved)))
    new = OmegaConf.create({**saved, "resume": "auto", "method": "fspo", "new_key": 3,
                            "clip": {"_target_": "fspo.clipping.fspo.FSPOClip", "alpha": 0.1}})
    cfg = resume_config(new, ResumePlan(ckpt_path=None, step=3, run_id="r"), tmp_path, overrides=["resume=auto"])
    assert OmegaConf.to_container(cfg.clip) == {"_target_": "fspo.clipping.sapo.SAPOClip", "tau_pos": 1.0}
    assert cfg.method == "sapo" and cfg.new_key == 3  # a key the run's config lacks elsewhere: its default


def test_a_deleted_manifest_is_named_with_what_was_and_was_not_verified(tmp_path, caplog):
    """A checkpoint without a manifest is not 'written by an older version' when its neighbours have manifests."""
    ck = tmp_path / "checkpoints"
    _ckpt(ck, 2)
    last = _ckpt(ck, 4)
    (ck / (last.name + ".sha256")).unlink()
    with caplog.at_level("WARNING"):
        plan = resolve_resume(OmegaConf.create({"resume": "auto"}), tmp_path)
    assert Path(plan.ckpt_path) == last
    text = caplog.text
    assert "step_000004.ckpt.sha256 is MISSING (deleted? 1 other checkpoints here have theirs)" in text
    assert "bytes were NOT verified" in text and "RL step 4" in text and "older version" not in text
