"""Bad input is refused early with one line each: no traceback, no hang, no circular advice.

Owns: ``cpu_threads`` above the usable cores (refused by the config check), ``<output_dir>/checkpoints``
being a file (refused before anything is written), a malformed model config (config.json, model.arch), fp16 on the CPU, W&B chosen without an API key and not offline (one
line at start-up, through experiments/run.py), and prompts longer than the context (the advice names a
value, and that value works on the real engine). Leaves out: the other bad-input cases (test_bad_input.py,
test_config_check.py) and crafted checkpoints (test_untrusted_files.py).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from conftest import REPO, SMALL


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
def test_wandb_without_key_or_offline_fails_at_start_with_one_line(tmp_path):
    pytest.importorskip("wandb")
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_") and k != "HYDRA_FULL_ERROR"}
    env.update(HOME=str(tmp_path), MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path}/m.db", HF_HUB_OFFLINE="1",
               PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "experiments/run.py", *SMALL, "steps=1", "val.size=0", "logger=wandb",
                        f"output_dir={tmp_path / 'out'}", f"hydra.run.dir={tmp_path / 'h'}"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    lines = [x for x in p.stderr.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "WANDB_API_KEY" in lines[0] and "logger.offline=true" in lines[0], p.stderr[-3000:]
    assert not (tmp_path / "out" / "checkpoints").exists()


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
