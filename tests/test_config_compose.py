"""Every config under conf/ composes, resolves and instantiates; every method x model composes.

The option list is globbed from conf/ (recursively), so a new clip rule, reward, dataset or method
yaml is tested without touching this file. Groups in the root defaults list are selected with
``group=option``; the others (method/, model/, experiment/, eval_data/, nested groups) are appended
with ``+group=option``, as on the command line. Other primary configs in conf/ (evaluate.yaml) and
the multirun files in sweeps/ (primary configs used with ``--config-dir sweeps``) compose too.
Components that need an optional package missing here (vLLM) must fail with an ImportError that
says how to install it; their class must still import.
"""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
from hydra.errors import InstantiationException, MissingConfigException
from hydra.utils import get_class, instantiate
from omegaconf import OmegaConf, open_dict

from conftest import CONF, REPO, compose_config

ROOT = OmegaConf.load(CONF / "config.yaml")
ROOT_GROUPS = {str(k).split("@")[0] for d in ROOT.defaults if OmegaConf.is_dict(d) for k in d}
OPTIONS = sorted((str(p.parent.relative_to(CONF)), p.stem) for p in CONF.rglob("*.yaml") if p.parent != CONF)
METHODS = sorted(p.stem for p in (CONF / "method").glob("*.yaml"))
MODELS = sorted(p.stem for p in (CONF / "model").glob("*.yaml"))
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
PRIMARY = sorted(p.stem for p in CONF.glob("*.yaml") if p.stem != "config")
SWEEPS = sorted(p for p in (REPO / "sweeps").glob("*.yaml") if not p.name.startswith("_"))
OPTIONAL_PACKAGES = ("vllm",)  # not in the default test environment

# independent expectations for the presets the paper defines
PAPER_CLIP = {"fspo": "fspo.clipping.fspo.FSPOClip", "grpo": "fspo.clipping.grpo.GRPOClip",
              "rloo": "fspo.clipping.rloo.RLOOClip", "gspo": "fspo.clipping.gspo.GSPOClip"}
PAPER_HUB = {"tiny": None, "qwen3_1_7b": "Qwen/Qwen3-1.7B-Base", "qwen3_8b": "Qwen/Qwen3-8B-Base"}


def selector(group: str, option: str) -> str:
    return f"{group}={option}" if group in ROOT_GROUPS else f"+{group}={option}"


def data_dir_of(node) -> Path | None:
    """The folder a data config reads (None if it reads no files); relative -> project root."""
    d = node.get("data_dir") if OmegaConf.is_dict(node) else None
    if d is None:
        return None
    p = Path(str(d)).expanduser()
    return p if p.is_absolute() else REPO / p


def instantiate_optional(node):
    """instantiate(node); if it fails only because an optional package is not installed here,
    check the class imports and the error says how to get the package, and return None."""
    try:
        return instantiate(node)
    except InstantiationException as e:
        missing = [p for p in OPTIONAL_PACKAGES if importlib.util.find_spec(p) is None]
        if not isinstance(e.__cause__, ImportError) or not any(p in str(e) for p in missing):
            raise
        get_class(node._target_)
        assert "pip install" in str(e) or "install" in str(e), str(e)
        return None


def check_components(cfg, tmp_path) -> None:
    """Instantiate the pieces train.py builds (except model and data) and check their types/outputs."""
    import lightning as L

    from fspo.clipping.base import ClipRule
    from fspo.rollout.base import RolloutEngine, SamplingConfig
    from fspo.update.settings import PPOConfig

    OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves (train.py logs it resolved)

    clip = instantiate(cfg.clip)
    assert isinstance(clip, ClipRule)
    # on-policy (new == old) the clip is never binding and the loss is -A on every response token
    lp = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    res = clip(lp, lp.clone(), torch.tensor([1.0, -2.0]), mask)
    torch.testing.assert_close(res.token_loss, torch.tensor([[-1.0, -1.0, 0.0], [2.0, 0.0, 0.0]]))
    assert not res.clipped.any()

    agg = instantiate(cfg.aggregator)
    out = agg(res.token_loss, mask)
    assert out.loss.ndim == 0 and math.isfinite(float(out.loss))

    # group 0 rewards (1, 0, 0, 1), group 1 all equal: every estimator is zero-sum per group and
    # gives exactly 0 to the all-equal group
    adv_fn = instantiate(cfg.advantage)
    rewards, groups = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0]), torch.tensor([0, 0, 0, 0, 1, 1])
    adv = adv_fn(rewards, groups)
    assert adv.shape == (6,) and torch.isfinite(adv).all()
    assert float(adv[:4].sum()) == pytest.approx(0.0, abs=1e-6)
    assert adv[4:].tolist() == [0.0, 0.0]
    expected = {"fspo.advantages.grpo": 0.5 / math.sqrt(1 / 3),  # (R - mean) / std, std unbiased
                "fspo.advantages.rloo": 1 - 1 / 3,  # R - mean of the other three
                "fspo.advantages.drgrpo": 0.5}.get(cfg.advantage._target_)
    if expected is not None:
        torch.testing.assert_close(adv[:4], torch.tensor([1.0, -1.0, -1.0, 1.0]) * expected,
                                   rtol=1e-5, atol=1e-6)

    assert isinstance(instantiate(cfg.ppo), PPOConfig)
    reward = instantiate(cfg.reward)
    assert callable(reward)
    if hasattr(reward, "close"):
        reward.close()
    engine = instantiate_optional(cfg.rollout.engine)
    assert engine is None or isinstance(engine, RolloutEngine)
    assert isinstance(instantiate(cfg.rollout.sampling), SamplingConfig)
    val_sampling = instantiate(cfg.val.sampling)
    assert isinstance(val_sampling, SamplingConfig) and val_sampling.n >= 1
    trainer = instantiate(cfg.trainer, logger=False, default_root_dir=str(tmp_path))
    assert isinstance(trainer, L.Trainer)
    for lcfg in [cfg.logger, *(cfg.get("extra_loggers") or {}).values()]:  # save_dir null: the run's output_dir
        logger = instantiate(lcfg, **({"save_dir": str(tmp_path)} if lcfg.get("save_dir", "") is None else {}))
        assert type(logger).__name__ == lcfg._target_.rsplit(".", 1)[1]  # constructing it touches no store


def option_target(group: str, option: str) -> str:
    """The ``_target_`` that ``group/option`` states, or that the schema it extends (fspo/config) states."""
    from hydra.core.config_store import ConfigStore

    node = OmegaConf.load(CONF / group / f"{option}.yaml")
    if "_target_" in node:
        return node._target_
    return ConfigStore.instance().load(f"{group}/{node.defaults[0]}.yaml").node._target_


@pytest.mark.parametrize("group,option", OPTIONS, ids=[f"{g}/{o}" for g, o in OPTIONS])
def test_every_option_composes_and_instantiates(group, option, tmp_path):
    cfg = compose_config([selector(group, option)])
    # the option landed where Hydra puts it (its package) and the whole config still builds
    check_components(cfg, tmp_path)
    if group in ("clip", "advantage", "reward"):
        assert cfg[group]._target_ == option_target(group, option)
    if group == "method":
        assert cfg.method == option


DATA_OPTIONS = [(g, o) for g, o in OPTIONS if g.split("/")[0] in ("data", "eval_data")]


@pytest.mark.parametrize("group,option", DATA_OPTIONS, ids=[f"{g}/{o}" for g, o in DATA_OPTIONS])
def test_data_sources_instantiate(group, option):
    cfg = compose_config([selector(group, option)])
    if group == "data":
        nodes = {"train": cfg.data.train, "val": cfg.data.val}
        folder = data_dir_of(cfg.data)
    else:  # eval sets: @package eval_data.<name>, each with a `source`
        nodes = {k: v.source for k, v in cfg.eval_data.items()}
        folder = next((data_dir_of(v) for v in nodes.values() if data_dir_of(v) is not None), None)
    if folder is not None and not folder.is_dir():
        pytest.skip(f"data folder {folder} is not present here")
    for name, node in nodes.items():
        src = instantiate(node)
        assert len(src) > 0, f"{group}/{option}: {name} is empty"
        s = src[0]
        assert isinstance(s.prompt, str) and s.prompt and isinstance(s.answer, str) and s.answer


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("method", METHODS)
def test_every_method_with_every_model(method, model, tmp_path):
    cfg = compose_config([f"+method={method}", f"+model={model}"])
    assert cfg.method == method
    assert cfg.model.name == model
    # the clip rule the method selects: the paper's for the four presets, else the one its yaml names
    if method in PAPER_CLIP:
        assert cfg.clip._target_ == PAPER_CLIP[method]
    else:
        picked = [d["override /clip"] for d in OmegaConf.load(CONF / "method" / f"{method}.yaml").defaults
                  if "override /clip" in d]
        assert picked and cfg.clip._target_ == option_target("clip", picked[0])
    stated = OmegaConf.load(CONF / "model" / f"{model}.yaml")
    expected_hub = PAPER_HUB[model] if model in PAPER_HUB else stated.get("hub_id")
    assert cfg.model.hub_id == expected_hub
    assert cfg.model.source in ("warmstart", "random", "pretrained")
    check_components(cfg, tmp_path)


def test_root_defaults_equal_fspo_tiny():
    """conf/config.yaml says its inline values are the FSPO / tiny presets: appending them changes nothing."""
    plain = OmegaConf.to_container(compose_config([]), resolve=True)
    explicit = OmegaConf.to_container(compose_config(["+method=fspo", "+model=tiny"]), resolve=True)
    assert plain == explicit


@pytest.mark.parametrize("group,choices", [("method", METHODS), ("model", MODELS)])
def test_unknown_choice_lists_the_available_ones(group, choices):
    assert len(choices) >= 3
    with pytest.raises(MissingConfigException) as e:
        compose_config([f"+{group}=no_such_{group}"])
    text = str(e.value)
    assert f"no_such_{group}" in text
    for c in choices:
        assert c in text, f"{c!r} missing from the error: {text}"
    if group == "method":
        assert all(m in text for m in ("fspo", "grpo", "rloo", "gspo"))


def _sweep_overrides(path: Path):
    """Override lists for a Hydra multirun file: the first value of every swept key together, then
    each further value of each key alone (the full grid would be too many)."""
    params = OmegaConf.select(OmegaConf.load(path), "hydra.sweeper.params") or {}
    grid = {k: [c.strip() for c in str(v).split(",")] for k, v in params.items()}
    yield [f"{k}={vals[0]}" for k, vals in grid.items()]
    for k, vals in grid.items():
        for v in vals[1:]:
            yield [f"{k}={v}"]


@pytest.mark.skipif(not SWEEPS, reason="no sweeps/*.yaml in this checkout")
@pytest.mark.parametrize("path", SWEEPS, ids=[p.stem for p in SWEEPS])
def test_sweeps_compose(path, tmp_path, monkeypatch):
    monkeypatch.setenv("FSPO_MLFLOW_PARENT_RUN_ID", "0" * 32)  # set by the sweep's Hydra callback
    n = 0
    for overrides in _sweep_overrides(path):
        cfg = compose_config(overrides, config_name=path.stem, config_dir=path.parent, return_hydra_config=True)
        for _name, cb in (OmegaConf.select(cfg, "hydra.callbacks") or {}).items():
            get_class(cb._target_)  # the sweep's Hydra callbacks import
        with open_dict(cfg):
            del cfg["hydra"]  # its ${now:...} / ${hydra.job.num} resolve only inside a Hydra run
        check_components(cfg, tmp_path)
        for o in overrides:  # the swept value landed
            key, value = o.lstrip("+").split("=", 1)
            if key == "method":
                assert cfg.method == value
            elif not (CONF / key).is_dir() and not (path.parent / key).is_dir():  # a group: conf/ or sweeps/arm/
                assert str(OmegaConf.select(cfg, key)) == value, (o, OmegaConf.select(cfg, key))
        n += 1
    assert n >= 1


@pytest.mark.parametrize("name", PRIMARY)
def test_other_primary_configs_compose_and_instantiate(name, tmp_path):
    """conf/<name>.yaml (e.g. evaluate.yaml): composes, resolves, and every ``_target_`` node
    instantiates (data sources only where their files are here)."""
    cfg = compose_config([], config_name=name)
    OmegaConf.to_container(cfg, resolve=True)
    built = []

    def walk(node, path):
        if OmegaConf.is_dict(node) and "_target_" in node:
            folder = data_dir_of(node)
            if folder is not None and not folder.is_dir():
                return
            if path == "trainer":
                obj = instantiate(node, logger=False, default_root_dir=str(tmp_path))
            else:
                obj = instantiate_optional(node)
            if hasattr(obj, "close"):
                obj.close()
            built.append(path)
        elif OmegaConf.is_dict(node):
            for k in node:
                walk(node[k], f"{path}.{k}" if path else str(k))

    walk(cfg, "")
    assert built, f"conf/{name}.yaml has no instantiable component"


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_experiment_presets_with_every_method_in_either_order(experiment, method):
    a = compose_config([f"+experiment={experiment}", f"+method={method}"])
    b = compose_config([f"+method={method}", f"+experiment={experiment}"])
    assert OmegaConf.to_container(a, resolve=True) == OmegaConf.to_container(b, resolve=True)
    assert a.method == method
    if method in PAPER_CLIP:
        assert a.clip._target_ == PAPER_CLIP[method]
    # the preset's own settings survive the method choice
    preset = OmegaConf.load(CONF / "experiment" / f"{experiment}.yaml")
    for key in ("steps", "prompts_per_step", "rollout.sampling.n", "ppo.mini_batch_size", "ppo.lr"):
        want = OmegaConf.select(preset, key)
        if want is not None:
            assert OmegaConf.select(a, key) == want, key
