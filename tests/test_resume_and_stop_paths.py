"""Resume and stop paths that must not do the wrong thing quietly, and files from elsewhere that end in one line.

Owns: ``resume=auto`` after a death before the MLflow run existed (the saved ``run_config.yaml`` is the run's
config; it is not overwritten by this command line's defaults); a damaged saved config (one line); a dry run
with ``resume=<garbage>`` (one line, and it writes nothing into the run's folder: ``.hydra/`` and ``run.log``
untouched); a checkpoint write that fails on a full disk leaves no ``.partial``; a resume on a disk without room
for its next checkpoint is refused up front; ``checkpoints/`` replaced by a file mid-run; ``export_lora`` on
non-torch and crafted files, a pickle ``pytorch_model.bin`` in ``model.path``, a malformed ``run_config.yaml``
given to evaluate (one line each, nothing run); every ``from_pretrained`` passes ``trust_remote_code=False``.
Leaves out: stop signals themselves (test_signals.py, test_continue_command.py).
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from test_signals import FakeTrainer, good_writer
from test_untrusted_files import Payload

from conftest import REPO, SMALL, compose_config, run_script_in_process
from fspo.runtime.checkpoints.checkpointing import StepCheckpoint
from fspo.runtime.checkpoints.resume import ResumePlan, check_room
from fspo.runtime.checks.errors import user_error
from fspo.runtime.checks.run_config import RUN_CONFIG_FILE, resume_config, save_run_config

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
       "OMP_NUM_THREADS": "1"}
EXPORT_LORA = REPO / "experiments" / "export_lora.py"  # run in this process: the checks need no fresh interpreter


def _one_line(exc: BaseException) -> str:
    msg = user_error(exc)
    assert msg is not None and "\n" not in msg, (type(exc), exc)
    return msg


def test_resume_auto_after_a_death_before_the_mlflow_run_keeps_the_saved_config(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    first = compose_config(SMALL + ["seed=5", "steps=3"], output_dir=out)
    save_run_config(first, out)  # the attempt died here: no MLflow run id, no checkpoint
    again = compose_config(["resume=auto"], output_dir=out)
    got = resume_config(again, ResumePlan(), out, overrides=["resume=auto"])
    assert (got.seed, got.steps, got.model.source) == (5, 3, "random")
    saved = OmegaConf.load(out / RUN_CONFIG_FILE)
    assert (saved.seed, saved.steps) == (5, 3)  # not overwritten with this command line's defaults

    (out / RUN_CONFIG_FILE).write_text("seed: [1,\n")  # damaged
    with pytest.raises(ValueError) as e:
        resume_config(again, ResumePlan(), out, overrides=["resume=auto"])
    assert "not a readable config" in _one_line(e.value)


def test_a_dry_run_with_a_garbage_resume_path_says_so_and_writes_nothing(tmp_path):
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text("the run's own\n")
    (run / "run.log").write_text("the run's log\n")
    p = subprocess.run([sys.executable, str(REPO / "experiments" / "run.py"), f"hydra.run.dir={run}", "dry_run=true",
                        f"resume={tmp_path / 'no_such.ckpt'}"], cwd=tmp_path, env=ENV, capture_output=True, text=True,
                       timeout=300)
    errors = [x for x in p.stderr.splitlines() if x.startswith("error:")]
    assert p.returncode == 2 and len(errors) == 1 and "no such checkpoint" in errors[0], p.stdout + p.stderr
    assert "fits" not in p.stdout
    assert (run / ".hydra" / "config.yaml").read_text() == "the run's own\n"
    assert (run / "run.log").read_text() == "the run's log\n"
    assert sorted(x.name for x in (run / ".hydra").iterdir()) == ["config.yaml"]


def test_a_failed_checkpoint_write_leaves_no_partial_file(tmp_path):
    ck = tmp_path / "checkpoints"
    cb = StepCheckpoint(ck, every_n_steps=2, keep_last=2)
    cb._save(FakeTrainer(good_writer(2)), 2)

    def full(p):
        Path(p).write_bytes(b"x" * 4096)
        raise OSError(28, "No space left on device (simulated)")

    with pytest.raises(OSError):
        cb._save(FakeTrainer(full), 4)
    assert not list(ck.glob("*.partial")) and [p.name for p in ck.glob("step_*.ckpt")] == ["step_000002.ckpt"]

    shutil.rmtree(ck)
    ck.write_text("not a folder")  # checkpoints/ replaced by a file while the run went on
    with pytest.raises(ValueError) as e:
        cb._save(FakeTrainer(good_writer(6)), 6)
    assert "is a file" in _one_line(e.value)


def test_a_resume_without_room_for_its_next_checkpoint_is_refused_up_front(tmp_path, monkeypatch):
    ck = tmp_path / "checkpoints"
    StepCheckpoint(ck)._save(FakeTrainer(good_writer(2)), 2)
    plan = ResumePlan(ckpt_path=str(ck / "step_000002.ckpt"), step=2)
    check_room(plan, tmp_path)  # plenty of room here
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10 << 30, 10 << 30, 100))
    with pytest.raises(ValueError) as e:
        check_room(plan, tmp_path)
    assert "disk full" in _one_line(e.value)


@pytest.mark.parametrize("content", [b"not a checkpoint at all", b"PK\x03\x04 a zip header and nothing else"])
def test_export_lora_on_a_file_that_is_no_checkpoint_is_one_line(tmp_path, content):
    f = tmp_path / "step_000001.ckpt"
    f.write_bytes(content)
    p = run_script_in_process(EXPORT_LORA, [f, tmp_path / "out"])
    errors = [x for x in p.stderr.splitlines() if x.startswith("error:")]
    assert p.returncode == 2 and len(errors) == 1 and "Traceback" not in p.stderr, p.stderr[-3000:]


def test_export_lora_on_a_crafted_checkpoint_runs_nothing(tmp_path):
    marker, f = tmp_path / "pwned", tmp_path / "step_000001.ckpt"
    torch.save({"fspo_resume": {"run_config": "x"}, "x": Payload(marker)}, f)
    p = run_script_in_process(EXPORT_LORA, [f, tmp_path / "out"])  # Payload is importable here: the bait is live
    assert p.returncode == 2 and "refused" in p.stderr and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert not marker.exists()


def _model_folder(tmp_path) -> Path:
    src = REPO / "fspo" / "assets" / "tiny_warmstart"
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def test_pickle_weights_in_model_path_are_refused(tmp_path):
    from fspo.models.loading import load_policy

    m = _model_folder(tmp_path)
    (m / "model.safetensors").unlink()
    marker = tmp_path / "pwned"
    torch.save({"x": Payload(marker)}, m / "pytorch_model.bin")
    with pytest.raises(ValueError) as e:
        load_policy(name="tiny", source="pretrained", path=str(m), seed=0)
    assert "pickle weights" in _one_line(e.value) and "safetensors" in str(e.value)
    assert not marker.exists()


def test_no_model_folder_code_is_ever_trusted(tmp_path, monkeypatch):
    import transformers

    from fspo.models.loading import load_policy

    seen = []
    for cls in (transformers.AutoTokenizer, transformers.AutoModelForCausalLM, transformers.AutoConfig):
        real = cls.from_pretrained.__func__

        def spy(c, *a, _real=real, **k):
            seen.append((c.__name__, k.get("trust_remote_code", "not passed")))
            return _real(c, *a, **k)

        monkeypatch.setattr(cls, "from_pretrained", classmethod(spy))
    m = _model_folder(tmp_path)
    load_policy(name="tiny", source="pretrained", path=str(m), seed=0)
    assert seen and all(v is False for _, v in seen), seen


def test_evaluate_on_a_malformed_run_config_is_one_line(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    StepCheckpoint(run / "checkpoints")._save(FakeTrainer(good_writer(1)), 1)
    (run / RUN_CONFIG_FILE).write_text("model: {name: [tiny\n")
    spec = importlib.util.spec_from_file_location("evaluate_app", REPO / "experiments" / "evaluate.py")
    app = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(app)
    cfg = OmegaConf.create({"mlflow": {"tracking_uri": f"sqlite:///{tmp_path / 'm.db'}"}, "train_run_id": None,
                            "checkpoints": str(run)})
    with pytest.raises(ValueError) as e:
        app._training_run(cfg)
    assert f"{run / RUN_CONFIG_FILE} is not a readable run config" in _one_line(e.value)
