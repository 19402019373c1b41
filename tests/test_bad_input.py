"""Bad input ends in one clear line, early: no traceback, no hang, no circular advice.

Owns, through the real entry point (`experiments/run.py` as a subprocess): a config typo, an unknown method,
an empty prompt set, a prompt longer than ``data.max_prompt_len`` (the run goes on), a missing model path and a
hub id offline (fast: no hub retries), W&B chosen without an API key and not offline (one line at start-up).
Owns, in process: ``cpu_threads`` above the usable cores and fp16 on the CPU (refused by the config check),
``<output_dir>/checkpoints`` being a file (refused before anything is written), a malformed model config
(config.json, model.arch), and prompts longer than the context (the advice names a value, and that value works
on the real engine). Leaves out: the config rule table (test_config_check.py) and crafted checkpoints
(test_untrusted_files.py).

The errors `fspo.runtime.checks.errors.user_error` recognises exit with code 2 and ONE line starting with
``error:``. Each case runs offline in its own temporary folder (Hydra run dir, MLflow store, HOME). The typo
and the unknown method are refused before the heavy imports: each runs ``python experiments/run.py``. The
cases that fail after them run in one subprocess, ``python -c DRIVER``: it imports the heavy modules once,
then runs experiments/run.py unchanged as ``__main__`` (runpy, the case's argv) per case, with a clock per
case. "Fast" is measured after the imports: on a shared 2-core CI machine importing torch, Lightning, MLflow
and transformers alone took 10-40 s of wall time, which says nothing about the code under test.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import Callable

import mlflow
import pytest
from omegaconf import OmegaConf

from conftest import REPO, SMALL, register_entry_case

NOT_MODEL = [s for s in SMALL if not s.startswith("model.")]  # keep +model=... in charge of the model
# the Qwen3 configs carry their architecture (model.arch), so the memory plan of an 8B full fine-tune refuses a
# CPU host before loading, and they train on GPUs (model.device=cuda: with none visible, one line says so); the
# model-loading tests below ask for the CPU and turn the plan off to reach the loader's own errors
NO_PLAN = ["memory_plan.check=false", "trainer.accelerator=cpu"]


def run(args, tmp_path):
    """Run experiments/run.py with ``args`` in a fresh process (for the refusals before the heavy imports)."""
    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "FSPO_DATA_DIR")}
    env.update(MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path}/m.db", HF_HUB_OFFLINE="1",
               HF_HOME=str(tmp_path / "hf"), PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "experiments/run.py", *args, f"hydra.run.dir={tmp_path}/h"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)


# the cases that fail after the heavy imports: they run in one interpreter (conftest's `entry_case`), each in its
# own folder {dir} (Hydra run dir, MLflow store, HOME)
CASE_ENV = {"MLFLOW_TRACKING_URI": "sqlite:///{dir}/m.db", "HOME": "{dir}"}
for _name, _argv in (("empty", [*SMALL, "data.train.size=0"]),
                     ("prompt_len", [*SMALL, "data.max_prompt_len=4", "logger.experiment_name=bad_prompt_len"]),
                     ("model_path", [*NOT_MODEL, *NO_PLAN, "+model=qwen3_8b", "model.path=/nonexistent"]),
                     ("hub_offline", [*NOT_MODEL, *NO_PLAN, "+model=qwen3_8b"])):
    register_entry_case(f"bad_input/{_name}", [*_argv, "hydra.run.dir={dir}/h"], CASE_ENV)
# no W&B key, not offline: HOME without a .netrc, no WANDB_* variable
register_entry_case("bad_input/wandb", [*SMALL, "steps=1", "val.size=0", "logger=wandb", "output_dir={dir}/out",
                                        "hydra.run.dir={dir}/h"], CASE_ENV)


@pytest.fixture
def driven(entry_case) -> Callable[[str], tuple]:
    """``driven(case)`` -> (CompletedProcess, seconds after the imports, the case's folder)."""
    return lambda case: entry_case(f"bad_input/{case}")


def single_error_line(proc) -> str:
    """The process exited 2 with exactly one ``error:`` line and no traceback; return that line."""
    assert proc.returncode == 2, f"exit {proc.returncode}\nstderr:\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


def test_config_typo_names_the_key(tmp_path):
    proc = run([*SMALL, "ppo.mini_batch_sise=3"], tmp_path)
    assert proc.returncode != 0
    assert "mini_batch_sise" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_unknown_method_lists_the_choices(tmp_path):
    proc = run([*SMALL, "+method=foo"], tmp_path)
    assert proc.returncode != 0
    assert "method/foo" in proc.stderr
    for m in ("fspo", "grpo", "rloo", "gspo"):
        assert m in proc.stderr


@pytest.mark.slow  # a full import of the stack: 10-35 s on a loaded 2-core machine
def test_empty_prompt_set(driven):
    proc, _, _ = driven("empty")
    line = single_error_line(proc)
    assert "empty" in line and "size" in line, line


@pytest.mark.slow
def test_prompt_longer_than_max_prompt_len_keeps_the_run(driven):
    proc, _, folder = driven("prompt_len")
    line = single_error_line(proc)
    assert "data.max_prompt_len" in line and "4" in line, line
    # the failure came after the MLflow run started (first validation): the run and its params
    # are still in the store, marked as failed
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{folder}/m.db")
    exp = client.get_experiment_by_name("bad_prompt_len")
    assert exp is not None
    (r,) = client.search_runs([exp.experiment_id])
    assert r.data.params["data/max_prompt_len"] == "4" and r.data.params["method"] == "fspo"
    assert r.info.status == "FAILED"


@pytest.mark.slow  # a full import of the stack: 10-35 s on a loaded 2-core machine
def test_missing_model_path_fails_fast(driven):
    proc, elapsed, _ = driven("model_path")
    line = single_error_line(proc)
    assert "model.path" in line and "/nonexistent" in line, line
    assert elapsed < 30, f"took {elapsed:.0f} s after the imports"


@pytest.mark.slow  # a full import of the stack: 10-35 s on a loaded 2-core machine
def test_hub_id_offline_fails_fast_and_says_use_model_path(driven):
    proc, elapsed, _ = driven("hub_offline")
    line = single_error_line(proc)
    assert "Qwen/Qwen3-8B-Base" in line and "model.path" in line, line
    assert elapsed < 30, f"took {elapsed:.0f} s after the imports"


def test_cpu_threads_above_the_cores_is_refused(compose_cfg):
    from fspo.runtime.checks.config_check import ConfigError, check_config, usable_cores

    cfg = compose_cfg(SMALL + ["cpu_threads=100000"])
    with pytest.raises(ConfigError, match=rf"cpu_threads=100000: is above the {usable_cores()} cores.*"
                                          rf"set cpu_threads={usable_cores()} or less"):
        check_config(cfg)
    check_config(compose_cfg(SMALL + [f"cpu_threads={usable_cores()}"]))


def test_checkpoints_path_that_is_a_file_is_refused_before_anything(tmp_path):
    from fspo.runtime.checkpoints.resume import resolve_resume
    from fspo.runtime.checks.errors import user_error

    (tmp_path / "checkpoints").write_text("not a folder")
    for mode in (None, "auto"):
        with pytest.raises(ValueError) as e:
            resolve_resume(OmegaConf.create({"resume": mode}), tmp_path)
        msg = user_error(e.value)
        assert "checkpoints is a file" in msg and "another output_dir" in msg and "\n" not in msg
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints"]


@pytest.mark.slow  # > 2.5 s: out of the quick loop (-m "not slow"), still in CI
def test_wandb_without_key_or_offline_fails_at_start_with_one_line(driven):
    pytest.importorskip("wandb")
    p, _, folder = driven("wandb")
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    lines = [x for x in p.stderr.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "WANDB_API_KEY" in lines[0] and "logger.offline=true" in lines[0], p.stderr[-3000:]
    assert not (folder / "out" / "checkpoints").exists()


def test_wandb_login_check_accepts_a_key_a_netrc_entry_or_offline(tmp_path, monkeypatch):
    from fspo.tracking.logger import check_wandb_login

    for k in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(ValueError, match="no API key"):
        check_wandb_login(False)
    check_wandb_login(True)
    monkeypatch.setenv("WANDB_MODE", "offline")
    check_wandb_login(False)
    monkeypatch.delenv("WANDB_MODE")
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password abc\n")
    os.chmod(tmp_path / ".netrc", 0o600)
    check_wandb_login(False)


@pytest.mark.parametrize("prompt_len", [40, 600])
def test_context_advice_offers_a_value_that_works(prompt_len):
    """The tiny model's context is 512: a prompt of 40 tokens + 500 new tokens does not fit; the error names
    max_new_tokens=472, which runs. A prompt of 600 tokens cannot fit at all: the advice says so."""
    from fspo.models.tiny import build_tiny_model, build_tokenizer
    from fspo.rollout.base import SamplingConfig
    from fspo.rollout.hf import HFEngine

    model, tok = build_tiny_model(seed=0), build_tokenizer()
    ctx = model.config.max_position_embeddings
    engine = HFEngine(batch_size=4)
    engine.setup(model, tok, "")
    prompt = [[5] * prompt_len]
    with pytest.raises(ValueError) as e:
        engine.generate(prompt, SamplingConfig(n=1, max_new_tokens=500, seed=0))
    msg = str(e.value)
    m = re.search(r"set rollout\.sampling\.max_new_tokens=(\d+)", msg)
    if prompt_len < ctx:
        assert m and int(m.group(1)) == ctx - prompt_len
        out = engine.generate(prompt, SamplingConfig(n=1, max_new_tokens=int(m.group(1)), seed=0, temperature=1.0))
        assert out.response_ids.shape[0] == 1
        assert "data.max_prompt_len" not in msg  # lowering it would not shorten the prompt: no circular advice
    else:
        assert m is None and "the prompt alone does not fit" in msg and "remove prompts over" in msg


def test_malformed_model_config_gets_one_line(tmp_path):
    from fspo.models.loading import load_policy
    from fspo.runtime.checks.errors import user_error

    (tmp_path / "config.json").write_text('{"model_type": "qwen3", "hidden_size": ')
    with pytest.raises(ValueError) as e:
        load_policy(source="pretrained", path=str(tmp_path))
    msg = user_error(e.value)
    assert msg and "config.json is malformed" in msg and str(tmp_path) in msg and "\n" not in msg
    with pytest.raises(ValueError) as e:
        load_policy(source="random", arch={"hidden_size": -3})
    msg = user_error(e.value)
    assert msg and "model.arch=" in msg and "does not build a model" in msg and "\n" not in msg


def test_fp16_on_cpu_is_refused_by_the_config_check(compose_cfg):
    from fspo.runtime.checks.config_check import ConfigError, check_config

    with pytest.raises(ConfigError, match="model.dtype=float16: .*CPU.*set model.dtype=float32"):
        check_config(compose_cfg(SMALL + ["model.dtype=float16"]))
