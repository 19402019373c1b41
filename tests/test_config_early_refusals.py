"""Typos in nested keys and values out of range are refused in seconds, before torch loads.

`fspo.cli.unknown_key_error` composes the config the command line selects (fspo/runtime/checks/config_keys.py)
and names the closest key of the node the typo was meant for (the clip rule's keys differ per rule);
`fspo.cli.early_error` (run.py's first check) checks the values on it (config_rules.py `check_values`).
Before, ``clip.c_uper=0.05`` got Hydra's advice to append ``+clip.c_uper``, which failed ~15 s later with a
TypeError, and ``clip.c_upper=-1`` was refused only after the memory plan.
"""
from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest

from fspo.cli import early_error, unknown_key_error

REPO = Path(__file__).resolve().parents[1]
BOUND_S = 3.0  # CPU seconds of the whole refusal, python start-up included


@pytest.mark.parametrize("argv,meant", [
    (["clip.c_uper=0.05"], "clip.c_upper"),
    (["+clip.c_uper=0.05"], "clip.c_upper"),
    (["+method=fspo", "clip.c_uper=0.05"], "clip.c_upper"),
    (["ppo.mini_batch_sise=8"], "ppo.mini_batch_size"),
    (["+method=fspo", "ppo.mini_batch_sise=8"], "ppo.mini_batch_size"),
    (["method=grpo", "clip.clip_ratio_hihg=0.3"], "clip.clip_ratio_high"),
    (["model.lora.rnak=4"], "model.lora.rank"),
    (["rollout.sampling.temprature=0.5"], "rollout.sampling.temperature"),
])
def test_nested_typo_names_the_key_meant(argv, meant):
    key = argv[-1].lstrip("+").split("=")[0]
    value = argv[-1].split("=")[1]
    assert unknown_key_error(argv) == f"unknown config key '{key}' in '{argv[-1]}': did you mean '{meant}'? " \
                                      f"({meant}={value})"


def test_nearest_key_comes_from_the_selected_rule():
    msg = unknown_key_error(["+method=gspo", "clip.c_uper=0.05"])
    assert msg == ("unknown config key 'clip.c_uper' in 'clip.c_uper=0.05': set one of clip._target_, "
                   "clip.clip_ratio_low, clip.clip_ratio_high")


@pytest.mark.parametrize("argv", [
    ["clip.c_upper=0.05", "clip.c_dual=0.05"], ["+logger.artifact_location=/tmp/a"], ["+rollout.engine.compact=true"],
    ["+method=grpo", "clip.clip_ratio_high=0.3"],
    ["--config-dir", "sweeps", "--config-name", "methods", "sweep.name=x"],
    ["-m", "+method=fspo,gspo", "clip.c_upper=0.05"], ["++brand.new=1"], ["hydra.run.dir=/tmp/x"],
])
def test_known_keys_and_appends_pass(argv):
    assert unknown_key_error(argv) is None


@pytest.mark.parametrize("argv,msg", [
    (["clip.c_upper=-1"], "clip.c_upper=-1: FSPOClip: c_upper must be > 0 and finite, got -1"),
    (["clip=fspo_ema", "clip.z=0"], "clip.z=0: FSPOClip: z must be > 0 and finite, got 0"),
    (["+method=grpo", "clip.clip_ratio_low=1.5"], "clip.clip_ratio_low=1.5: GRPOClip: clip_ratio_low must be < 1"),
    (["ppo.lr=-1"], "ppo.lr=-1: must be a number > 0"),
    (["+method=cispo", "clip.clip_ratio_low=2"], "clip.clip_ratio_low=2: CISPOClip: clip_ratio_low must be in [0, 1]"),
    (["+method=sapo", "clip.tau_neg=0"], "clip.tau_neg=0: SAPOClip: tau_neg must be > 0 and finite, got 0"),
    (["+method=gmpo", "clip.clip_ratio_high=-1"], "clip.clip_ratio_high=-1: GMPOClip: clip_ratio_high must be > 0"),
    (["clip.c_upper=1"], "clip.c_upper=1: FSPOClip: c_dual (0.03) must be >= c_upper (1)"),
    (["+method=dppo", "clip.divergence=js"], "clip.divergence=js: DPPOClip: divergence must be one of ['kl', 'tv']"),
    (["+method=cppo", "clip.w_min=1.5"], "clip.w_min=1.5: CPPOClip: w_min must be in (0, 1]"),
    (["+method=vespo", "clip.ref_length=0"], "clip.ref_length=0: VESPOClip: ref_length must be > 0"),
    (["+method=ctpo", "clip.ratio_mode=x"], "clip.ratio_mode=x: CTPOClip: ratio_mode must be one of"),
    (["+method=luspo", "clip.clip_ratio_low=1"], "clip.clip_ratio_low=1: LUSPOClip: clip_ratio_low must be < 1"),
    (["guard.max_kl=-1"], "guard.max_kl=-1: must be a number > 0 or null (a divergence limit); set guard.max_kl=1"),
    (["guard.action=halt"], "guard.action=halt: must be one of stop, skip, warn, off"),
    (["rollout.sampling.top_p=0"], "rollout.sampling.top_p=0: must be a number in (0, 1] (nucleus sampling mass); set"),
    (["rollout.sampling.n=0"], "rollout.sampling.n=0: must be a whole number >= 1"),
    (["rollout.sampling.min_new_tokens=200"], "rollout.sampling.min_new_tokens=200: must be in [0, rollout.sampling"),
])
def test_values_refused_before_anything_loads(argv, msg):
    assert early_error(argv).startswith(msg)
    assert "torch" not in subprocess.run(
        [sys.executable, "-c", f"import sys; from fspo.cli import early_error; early_error({argv!r}); "
         f"print(' '.join(m for m in sys.modules if m == 'torch'))"], cwd=REPO, capture_output=True, text=True
    ).stdout


def test_valid_values_pass():
    assert early_error(["clip.c_upper=0.05", "clip.c_dual=0.05", "ppo.lr=1e-5"]) is None
    assert early_error([]) is None


def test_a_value_that_does_not_resolve_yet_is_left_to_the_run(monkeypatch):
    monkeypatch.delenv("FSPO_UNSET_FOR_TEST", raising=False)
    assert early_error(["ppo.lr=${oc.env:FSPO_UNSET_FOR_TEST}"]) is None


@pytest.mark.parametrize("args,expect", [
    (["clip.c_uper=0.05"], "did you mean 'clip.c_upper'?"),
    (["ppo.mini_batch_sise=8"], "did you mean 'ppo.mini_batch_size'?"),
    (["+method=fspo", "clip.c_uper=0.05"], "did you mean 'clip.c_upper'?"),
    (["+method=fspo", "ppo.mini_batch_sise=8"], "did you mean 'ppo.mini_batch_size'?"),
    (["clip.c_upper=-1"], "clip.c_upper=-1: FSPOClip: c_upper must be > 0"),
])
def test_run_py_refuses_in_seconds(args, expect):
    """Bounded in CPU seconds of the process (user + system): wall time on a machine shared by several jobs
    measures the load, not the check (unloaded, wall ~ CPU: about 1-2 s with /usr/bin/time)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    p = subprocess.run([sys.executable, "experiments/run.py", *args], cwd=REPO, capture_output=True, text=True,
                       timeout=60)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    took = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert p.returncode == 2, p.stderr[-2000:]
    assert expect in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert took <= BOUND_S, f"refused after {took:.1f} CPU s"


def test_every_clip_rule_has_settings():
    from hydra.utils import instantiate

    from conftest import clip_config
    from fspo.clipping.settings import SETTINGS

    for path in sorted((REPO / "conf" / "clip").glob("*.yaml")):
        node = clip_config(path.stem)
        assert node._target_ in SETTINGS, path.name
        instantiate(node)  # each option's values pass its rule, and its settings class (the early check) agrees
        assert early_error([f"clip={path.stem}"]) is None, path.name


def test_settings_pin_the_rules():
    """The torch-free settings are the rules' own: same defaults, same band names, same aggregation modes."""
    import dataclasses
    import inspect

    from hydra.utils import get_class as hydra_get_class

    from fspo.clipping.fspo import FSPOClip
    from fspo.clipping.settings import FSPO_BANDS, FSPOSettings
    from fspo.losses import AGG_MODES
    from fspo.runtime.checks.config_rules import AGG_MODES as TABLE_AGG_MODES

    assert FSPOClip.BANDS == FSPO_BANDS and TABLE_AGG_MODES == AGG_MODES
    from fspo.clipping.settings import SETTINGS

    sig = inspect.signature(FSPOClip.__init__).parameters
    for name in ("c_upper", "c_lower", "c_dual", "band", "drift", "z", "alpha", "sigma0", "ratio_grad"):
        assert sig[name].default == getattr(FSPOSettings, name), name
    for target, cls in SETTINGS.items():  # every settings class takes exactly its rule's arguments
        rule = hydra_get_class(target)
        args = set(inspect.signature(rule.__init__).parameters) - {"self"}
        fields = {f.name for f in dataclasses.fields(cls)} - {"owner"}
        assert args <= fields, (target, args - fields)
        for name in args:  # the signature's default is the settings class's: stated once, in settings.py
            default = inspect.signature(rule.__init__).parameters[name].default
            assert default is inspect.Parameter.empty or default == getattr(cls, name, default), (target, name)


@pytest.mark.parametrize("argv,msg", [
    (["ppo.mini_batch_size=3"], "prompts_per_step=16 does not split into whole mini-batches of ppo.mini_batch_size=3"),
    (["ppo.autocast=bf16", "ppo.old_log_probs=engine"], "ppo.autocast=bf16 with ppo.old_log_probs=engine"),
])
def test_update_settings_refused_before_anything_loads(argv, msg):
    assert early_error(argv).startswith(msg)



def test_the_guard_and_the_correction_read_their_schemas_defaults():
    """`DivergenceGuard` is `GuardSettings`; `RolloutCorrection`'s defaults are `CorrectionSettings`' (stated once)."""
    import dataclasses
    import inspect

    from fspo.rollout.correction import RolloutCorrection
    from fspo.rollout.settings import CorrectionSettings
    from fspo.update.guard import DivergenceGuard
    from fspo.update.settings import GuardSettings

    assert issubclass(DivergenceGuard, GuardSettings) and dataclasses.fields(DivergenceGuard) == dataclasses.fields(
        GuardSettings)
    sig = inspect.signature(RolloutCorrection.__init__).parameters
    stated = [f.name for f in dataclasses.fields(CorrectionSettings) if f.default != "???"]
    assert stated and all(sig[k].default == getattr(CorrectionSettings, k) for k in stated)

def test_defaults_are_stated_once():
    """conf/config.yaml, conf/rollout/hf.yaml's ``sampling``, conf/clip/*.yaml, conf/model/*.yaml and
    conf/evaluate.yaml state no value their schema (fspo/config) states: each keeps what selects its schema,
    interpolations and the values that differ."""
    import dataclasses

    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    import fspo.config

    def restated(node, schema, prefix=""):
        out = []
        for f in dataclasses.fields(schema):
            if f.name not in node or node._get_node(f.name)._is_interpolation():
                continue
            if dataclasses.is_dataclass(f.default_factory):
                out += restated(node[f.name], f.default_factory, f"{prefix}{f.name}.")
            elif f.default is not dataclasses.MISSING and node[f.name] == f.default:
                out.append(prefix + f.name)
        return out

    schemas = {name: node for name, _, _, node in fspo.config.stored()}
    root = OmegaConf.load(REPO / "conf" / "config.yaml")
    assert root.defaults[-2:] == ["run_schema", "_self_"]
    assert restated(root, schemas["run_schema"]) == []
    assert set(root) == {"defaults", "hydra", "aggregator", "ppo", "rollout_correction", "diagnostics", "val"}
    hf = OmegaConf.load(REPO / "conf" / "rollout" / "hf.yaml")
    assert restated(hf.get("sampling") or OmegaConf.create(), schemas["schema"]) == []
    for path in sorted((REPO / "conf" / "clip").glob("*.yaml")):
        node = OmegaConf.load(path)
        assert list(node.defaults) == [node.defaults[0], "_self_"] and "_target_" not in node, path.name
        stored = ConfigStore.instance().load(f"clip/{node.defaults[0]}.yaml").node
        assert restated(node, schemas[node.defaults[0]]) == [] and stored._target_, path.name
    evaluate = OmegaConf.load(REPO / "conf" / "evaluate.yaml")  # its model node: the tiny default's keys
    assert "eval_model_schema@model" in evaluate.defaults and "model" not in evaluate
    for path in sorted((REPO / "conf" / "model").glob("*.yaml")):  # tiny.yaml is the defaults: only its name
        assert restated(OmegaConf.load(path), fspo.config.groups.ModelConfig) == ([] if path.stem != "tiny"
                                                                                 else ["name"]), path.name
