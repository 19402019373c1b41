"""Bad input through the real entry point: `experiments/run.py` as a subprocess.

A bad setting or input must end with a non-zero exit and a message that names the problem; the
ones `fspo.runtime.checks.errors.user_error` recognises exit with code 2 and ONE line starting with ``error:``
(no traceback). Model failures must be fast (no hub retries). Each case runs in its own temporary
folder (Hydra run dir, MLflow store, HF cache), offline.

"Fast" is measured after the imports: on a shared 2-core CI machine importing torch, Lightning,
MLflow and transformers alone took 10-40 s of wall time, which says nothing about the code
under test. For those cases the subprocess is ``python -c DRIVER``: it imports the heavy modules,
starts a clock, and runs experiments/run.py unchanged as ``__main__`` (runpy, same argv), writing
the seconds from the clock to exit into a file; the test bounds that time.
"""
from __future__ import annotations

import os
import subprocess
import sys

import mlflow
import pytest

from conftest import REPO, SMALL

NOT_MODEL = [s for s in SMALL if not s.startswith("model.")]  # keep +model=... in charge of the model
# the Qwen3 configs carry their architecture (model.arch), so the memory plan of an 8B full fine-tune refuses a
# CPU host before loading, and they train on GPUs (model.device=cuda: with none visible, one line says so); the
# model-loading tests below ask for the CPU and turn the plan off to reach the loader's own errors
NO_PLAN = ["memory_plan.check=false", "trainer.accelerator=cpu"]


DRIVER = """
import atexit, runpy, sys, time
import fspo.train  # noqa: F401  (torch, Lightning, ...)
import mlflow, lightning.pytorch.loggers  # noqa: F401,E401  (the MLflow logger imports them lazily)
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401  (load_policy imports them lazily)
clock, t0 = sys.argv[1], time.monotonic()
atexit.register(lambda: open(clock, "w").write(str(time.monotonic() - t0)))
sys.argv = ["experiments/run.py", *sys.argv[2:]]
runpy.run_path("experiments/run.py", run_name="__main__")
"""


def run(args, tmp_path, extra_env=None, timeout=300, clock=False):
    """Run experiments/run.py with ``args``; returns (CompletedProcess, seconds after the imports
    when ``clock`` else None)."""
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "FSPO_DATA_DIR")}
    env.update(MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path}/m.db", HF_HUB_OFFLINE="1",
               HF_HOME=str(tmp_path / "hf"), PYTHONWARNINGS="ignore")
    env.update(extra_env or {})
    argv = [*args, f"hydra.run.dir={tmp_path}/h"]
    clock_file = tmp_path / "clock.txt"
    cmd = [sys.executable, "-c", DRIVER, str(clock_file), *argv] if clock else \
        [sys.executable, "experiments/run.py", *argv]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    return proc, float(clock_file.read_text()) if clock else None


def single_error_line(proc) -> str:
    """The process exited 2 with exactly one ``error:`` line and no traceback; return that line."""
    assert proc.returncode == 2, f"exit {proc.returncode}\nstderr:\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


def test_config_typo_names_the_key(tmp_path):
    proc, _ = run([*SMALL, "ppo.mini_batch_sise=3"], tmp_path)
    assert proc.returncode != 0
    assert "mini_batch_sise" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_unknown_method_lists_the_choices(tmp_path):
    proc, _ = run([*SMALL, "+method=foo"], tmp_path)
    assert proc.returncode != 0
    assert "method/foo" in proc.stderr
    for m in ("fspo", "grpo", "rloo", "gspo"):
        assert m in proc.stderr


@pytest.mark.slow  # a full import of the stack: 10-35 s on a loaded 2-core machine
def test_empty_prompt_set(tmp_path):
    proc, _ = run([*SMALL, "data.train.size=0"], tmp_path)
    line = single_error_line(proc)
    assert "empty" in line and "size" in line, line


@pytest.mark.slow
def test_prompt_longer_than_max_prompt_len_keeps_the_run(tmp_path):
    proc, _ = run([*SMALL, "data.max_prompt_len=4", "logger.experiment_name=bad_prompt_len"], tmp_path)
    line = single_error_line(proc)
    assert "data.max_prompt_len" in line and "4" in line, line
    # the failure came after the MLflow run started (first validation): the run and its params
    # are still in the store, marked as failed
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/m.db")
    exp = client.get_experiment_by_name("bad_prompt_len")
    assert exp is not None
    (r,) = client.search_runs([exp.experiment_id])
    assert r.data.params["data/max_prompt_len"] == "4" and r.data.params["method"] == "fspo"
    assert r.info.status == "FAILED"


@pytest.mark.slow  # a full import of the stack: 10-35 s on a loaded 2-core machine
def test_missing_model_path_fails_fast(tmp_path):
    proc, elapsed = run([*NOT_MODEL, *NO_PLAN, "+model=qwen3_8b", "model.path=/nonexistent"], tmp_path, clock=True)
    line = single_error_line(proc)
    assert "model.path" in line and "/nonexistent" in line, line
    assert elapsed < 30, f"took {elapsed:.0f} s after the imports"


@pytest.mark.slow  # a full import of the stack: 10-35 s on a loaded 2-core machine
def test_hub_id_offline_fails_fast_and_says_use_model_path(tmp_path):
    proc, elapsed = run([*NOT_MODEL, *NO_PLAN, "+model=qwen3_8b"], tmp_path, extra_env={"HF_HUB_OFFLINE": "1"},
                        clock=True)
    line = single_error_line(proc)
    assert "Qwen/Qwen3-8B-Base" in line and "model.path" in line, line
    assert elapsed < 30, f"took {elapsed:.0f} s after the imports"
