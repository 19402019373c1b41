"""The typed config: the schemas of fspo/config stored before every composition of conf/, closing their nodes,
importing no torch, and rendered into ``--help`` and docs/configuration.md.

Owns: the checks that a fresh process composing conf/ through each entry point finds the schemas, that an
unknown key or a wrong type does not compose, that ``--help`` lists the typed settings, and that
docs/configuration.md's generated part is current. Leaves out: the values' ranges
(test_config_early_refusals.py) and the composed configs themselves (test_config_compose.py).
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
COMPOSE = ("from hydra import compose, initialize_config_dir\n"
           "with initialize_config_dir(config_dir='{conf}', version_base='1.3'):\n"
           "    cfg = compose('config', overrides=['+method=grpo'])\n"
           "assert cfg.ppo.lr == 2e-5 and cfg.clip.clip_ratio_high == 0.28, cfg.clip\n")



def _python(code: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120)


CHECK = "assert cfg.ppo.lr == 2e-5 and cfg.clip.clip_ratio_high == 0.28, cfg.clip\n"


@pytest.mark.parametrize("code", [
    f"import fspo.types\n{COMPOSE}",  # any fspo module: fspo/__init__.py stores the schemas
    f"from fspo.cli import early_error\n{COMPOSE}",  # experiments/run.py, evaluate.py
    "from fspo.sweeps import job_config\n" + COMPOSE,
    "from _common import compose\ncfg = compose(['+method=grpo'])\n" + CHECK,  # run in benchmarks/, as a script
], ids=["fspo", "cli", "sweeps", "benchmarks"])
def test_a_fresh_process_composes_with_the_schemas(code):
    folder = REPO / "benchmarks" if "_common" in code else REPO  # a benchmark script's neighbours: its folder
    p = _python(code.format(conf=REPO / "conf"), cwd=folder)
    assert p.returncode == 0, p.stderr[-2000:]


def test_run_py_composes_with_the_schemas():
    p = subprocess.run([sys.executable, "experiments/run.py", "+method=grpo", "--cfg", "job"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "clip_ratio_high: 0.28" in p.stdout and "lr: 2.0e-05" in p.stdout, p.stderr


def test_without_the_schemas_conf_does_not_compose():
    """The check above can fail: conf/ names the stored schemas, so a process that never imports fspo cannot
    compose it (every entry point imports fspo first)."""
    p = _python(COMPOSE.format(conf=REPO / "conf"))
    assert p.returncode != 0 and "_schema" in p.stderr, p.stderr[-2000:]


def test_schemas_import_no_torch():
    p = _python("import sys, fspo.config; assert 'torch' not in sys.modules, 'torch imported'")
    assert p.returncode == 0, p.stderr[-2000:]


@pytest.mark.parametrize("override,msg", [
    ("clip.c_upper=abc", "c_upper"),  # a wrong type (before the schemas: composed, refused after torch loaded)
    ("ppo.lr=fast", "lr"),
    ("ppo.mini_batch_size=2.5", "mini_batch_size"),
    ("clip=grpo clip.clip_ratio_c=off", "clip_ratio_c"),
    ("clip.c_uper=0.05", "c_uper"),  # an unknown key (``+clip.c_uper`` is Hydra's force-add: config_keys.py)
    ("+method=grpo clip.c_upper=0.05", "c_upper"),  # GRPO's node has no FSPO key
    ("steps=abc", "steps"),  # the root schema (RunConfig) and the nodes inside it
    ("steps=1.5", "steps"),
    ("val.sampling.n=two", "n"),
    ("guard.max_kl=high", "max_kl"),
    ("rollout_correction.cap=abc", "cap"),
    ("model.lora.rank=1.5", "rank"),
    ("guard.limit=1", "limit"),
    ("model.lora.rnak=8", "rnak"),
])
def test_unknown_keys_and_wrong_types_do_not_compose(override, msg):
    from hydra.errors import ConfigCompositionException
    from omegaconf.errors import OmegaConfBaseException

    from conftest import compose_config

    with pytest.raises((ConfigCompositionException, OmegaConfBaseException)) as e:
        compose_config(override.split())
    assert msg in f"{e.value} {e.value.__cause__}"


def test_help_lists_the_typed_settings():
    p = subprocess.run([sys.executable, "experiments/run.py", "--help"], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "ppo: PPOConfig (fspo/update/settings.py)" in p.stdout
    assert "  c_upper: 0.03  # upper band scale" in p.stdout and "clip=grpo: RatioClipSettings" in p.stdout


def test_configuration_page_is_current():
    from fspo.config import DOCS, docs_page

    text = DOCS.read_text()
    assert text == docs_page(text), "docs/configuration.md is stale: run `python -m fspo.config` and commit it"


@pytest.mark.parametrize("argv,msg", [
    (["clip.c_upper=abc"], "clip.c_upper=abc: Value 'abc' of type 'str' could not be converted to Float"),
    (["+method=grpo", "ppo.mini_batch_size=2.5"], "ppo.mini_batch_size=2.5: Value '2.5' of type 'float' could not"),
    (["steps=abc"], "steps=abc: Value 'abc' of type 'str' could not be converted to Integer"),
])
def test_run_py_names_a_wrong_type_in_one_line(argv, msg):
    from fspo.cli import early_error

    bad = early_error(argv)
    assert bad is not None and bad.startswith(msg) and "\n" not in bad, bad


def test_a_typed_float_is_shown_as_typed():
    """The schema makes ``clip.c_upper=-1`` a float; the message shows the value as the command line gave it."""
    from fspo.cli import early_error

    assert early_error(["clip.c_upper=-1"]) == "clip.c_upper=-1: FSPOClip: c_upper must be > 0 and finite, got -1"
    assert early_error(["ppo.lr=-1"]) == "ppo.lr=-1: must be a number > 0; set ppo.lr=2e-05"


def test_printed_keys_follow_the_config():
    """``--cfg job`` prints the config groups' nodes, then the run's keys in `RunConfig`'s order."""
    import dataclasses

    from conftest import compose_config
    from fspo.config.groups import RunConfig

    groups = ["data", "reward", "clip", "advantage", "rollout", "trainer", "logger", "checkpoint"]
    assert list(compose_config()) == groups + [f.name for f in dataclasses.fields(RunConfig)]


def test_one_checker_before_torch_and_in_check_config(monkeypatch):
    """run.py's early check and `check_config` run the same `check_values`; it builds the torch-free settings."""
    from conftest import compose_config
    from fspo.runtime.checks import config_check, config_keys, config_rules

    calls = []
    monkeypatch.setattr(config_rules, "check_values", lambda cfg, then=None: calls.append(then))
    monkeypatch.setattr(config_check, "check_values", config_rules.check_values)
    cfg = compose_config()
    assert config_keys.early_value_error(cfg) is None and config_check.check_config(cfg) == []
    assert len(calls) == 2 and calls[0] is None and callable(calls[1])
