"""Config validation before anything runs (fspo/runtime/checks/config_check.py).

Owns: each bad setting in `BAD` fails in `check_config` with one line naming the key and the fix;
`train` rejects them before a model loads, the output folder is written or an MLflow run opens; every
shipped option, method x model preset and experiment passes; warnings for settings that run but
probably diverge. Leaves out: the components' own argument checks (test_config_compose.py) and the
batch arithmetic (test_minibatch_unit.py).
"""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
from test_config_compose import EXPERIMENTS, METHODS, MODELS, OPTIONS, selector

from conftest import SMALL, compose_config
from fspo.runtime.checks.config_check import ConfigError, check_config
from fspo.runtime.checks.errors import user_error

# bad settings (and a few neighbours): override -> the key the one-line error must name
BAD = {
    "steps=0": "steps=0",  # a wrong type (steps=abc) does not compose: test_config_schemas.py
    "rollout.sampling.max_new_tokens=0": "rollout.sampling.max_new_tokens=0",
    "ppo.lr=-1": "ppo.lr=-1",
    "ppo.lr=1e38": "ppo.lr=1e+38",
    "ppo.mini_batch_size=0": "ppo.mini_batch_size=0",
    "ppo.micro_batch_max_tokens=0": "ppo.micro_batch_max_tokens=0",
    "rollout.sampling.n=1": "rollout.sampling.n=1",
    "val.size=-1": "val.size=-1",
    "rollout.sampling.temperature=0": "rollout.sampling.temperature=0",
    "rollout.sampling.min_new_tokens=30": "rollout.sampling.min_new_tokens=30",
    "checkpoint.keep_last=0": "checkpoint.keep_last=0",
    "guard.action=halt": "guard.action=halt",
    "guard.max_kl=-1": "guard.max_kl=-1",
}


@pytest.mark.parametrize("override", list(BAD))
def test_bad_setting_is_one_line_naming_key_and_fix(override):
    with pytest.raises(ConfigError) as e:
        check_config(compose_config([*SMALL, override]))
    line = user_error(e.value)  # what experiments/run.py prints after "error: "
    assert "\n" not in line and BAD[override] in line, line
    assert "; set " in line or "; use " in line or "; lower " in line, f"no fix named: {line}"


def test_one_sample_per_prompt_says_nothing_learns():
    with pytest.raises(ConfigError, match=r"rollout.sampling.n=1: .*\(grpo\) is 0.*set rollout.sampling.n >= 2"):
        check_config(compose_config([*SMALL, "rollout.sampling.n=1"]))


def test_high_learning_rate_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="fspo.runtime.checks.config_check"):
        warnings = check_config(compose_config([*SMALL, "ppo.lr=1e3"]))
    assert len(warnings) == 1 and "ppo.lr=1000" in warnings[0] and "guard" in warnings[0]
    assert "ppo.lr=1000" in caplog.text
    assert check_config(compose_config(SMALL)) == []


@pytest.mark.parametrize("override", ["ppo.mini_batch_size=0", "ppo.micro_batch_max_tokens=0", "steps=0"])
def test_train_rejects_before_loading_writing_or_opening_a_run(override, compose_cfg, monkeypatch):
    """Nothing happens before the check: no model load, no output folder, no MLflow experiment or run."""
    from mlflow.tracking import MlflowClient

    import fspo.train as ft

    def no_load(**_):
        raise AssertionError("the model was loaded before the config was checked")

    monkeypatch.setattr(ft, "load_policy", no_load)
    cfg = compose_cfg([*SMALL, override, f"logger.experiment_name=cfgcheck_{override.split('=')[0]}"])
    with pytest.raises(ConfigError, match=override.split("=")[0].replace(".", r"\.")):
        ft.train(cfg)
    assert not Path(cfg.output_dir).exists()
    assert MlflowClient(cfg.logger.tracking_uri).get_experiment_by_name(cfg.logger.experiment_name) is None


@pytest.mark.parametrize("group,option", OPTIONS, ids=[f"{g}/{o}" for g, o in OPTIONS])
def test_every_shipped_option_passes(group, option):
    check_config(compose_config([selector(group, option)]))


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("method", METHODS)
def test_every_method_with_every_model_passes(method, model):
    check_config(compose_config([f"+method={method}", f"+model={model}"]))


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_experiment_presets_pass(experiment):
    check_config(compose_config([f"+experiment={experiment}", "+method=fspo"]))


def test_absent_keys_are_not_checked():
    """A config saved before a key existed (resume restores it) still passes."""
    from omegaconf import OmegaConf, open_dict

    cfg = compose_config(SMALL)
    with open_dict(cfg):
        del cfg["guard"]
    check_config(cfg)
    assert OmegaConf.select(cfg, "guard") is None
