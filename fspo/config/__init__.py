"""The run's typed config: the settings dataclasses stored as schemas in Hydra's ConfigStore, and their docs.

Owns: `register` (run when fspo is imported, so every composition of conf/ finds the schemas its defaults lists
name): ``ppo_schema`` (the root's ``ppo:``: `PPOConfig`), ``diagnostics_schema``, ``memory_plan_schema`` and
``progress_schema`` (fspo/config/groups.py), ``sampling/schema`` (``rollout.sampling``) and
``clip/<rule>_schema`` (each rule's settings class
of fspo/clipping/settings.py with its ``_target_``; ``fspo_calibrated_schema`` adds the calibrated bands'
``calibration``). A schema types its node and closes it: an unknown key or a value of the wrong type does not
compose. `schema` (a settings dataclass as stored: ``_target_`` first), `field_docs` (a field's one-line doc: the
comment on its line), `render` (the schemas' fields, defaults and docs: the ``fspo_schema_help`` resolver of
``--help``) and `docs_page` (docs/configuration.md's generated part; ``python -m fspo.config`` rewrites it).
Imports no torch. Leaves out: value ranges (each settings class's ``__post_init__``, checked before anything loads
by fspo/runtime/checks/config_keys.py).
"""
from __future__ import annotations

import inspect
import re
from dataclasses import MISSING, field, fields, is_dataclass, make_dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, get_type_hints

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from fspo.clipping.settings import SETTINGS, FSPOSettings
from fspo.config.groups import DiagnosticsConfig, MemoryPlanConfig, ProgressConfig
from fspo.rollout.settings import SamplingConfig
from fspo.update.settings import PPOConfig

DOCS = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
BEGIN, END = "<!-- generated from the schemas: python -m fspo.config -->", "<!-- end of generated -->"
PPO_TARGET = "fspo.update.settings.PPOConfig"
SAMPLING_TARGET = "fspo.rollout.base.SamplingConfig"  # (re-exported there: stored configs name it so)
PACKAGES = {DiagnosticsConfig: "diagnostics", MemoryPlanConfig: "memory_plan", ProgressConfig: "progress"}
FSPO_TARGET = "fspo.clipping.fspo.FSPOClip"


def schema(cls: type, target: str, drop: Sequence[str] = ("owner",)) -> type:
    """``cls``'s fields but ``drop`` (types, defaults) as a dataclass led by ``_target_: str = target``."""
    hints = get_type_hints(cls)
    specs = [("_target_", str, field(default=target))]
    for f in fields(cls):
        if f.name not in drop:
            specs.append((f.name, hints[f.name], field(default=f.default, default_factory=f.default_factory)))
    return make_dataclass(cls.__name__, specs)


def stored() -> Iterator[Tuple[str, Optional[str], type, type]]:
    """(name, group, settings class, schema) of every stored schema."""
    yield "ppo_schema", None, PPOConfig, schema(PPOConfig, PPO_TARGET, drop=("betas",))
    for cls in (DiagnosticsConfig, MemoryPlanConfig, ProgressConfig):
        yield f"{PACKAGES[cls]}_schema", None, cls, cls
    for target, (cls, _) in SETTINGS.items():
        yield f"{target.split('.')[2]}_schema", "clip", cls, schema(cls, target, drop=("owner", "calibration"))
    yield "fspo_calibrated_schema", "clip", FSPOSettings, schema(FSPOSettings, FSPO_TARGET)
    yield "schema", "sampling", SamplingConfig, schema(SamplingConfig, SAMPLING_TARGET, drop=("seed",))


def register() -> None:
    cs = ConfigStore.instance()
    for name, group, _, node in stored():
        cs.store(name=name, group=group, node=node, package=name[:-len("_schema")] if group is None else None)


def field_docs(cls: type) -> Dict[str, str]:
    """{field: its one-line doc}: the comment on the field's line in ``cls`` or the base class that states it."""
    docs: Dict[str, str] = {}
    for c in reversed([c for c in cls.__mro__ if is_dataclass(c)]):
        for line in inspect.getsource(c).splitlines():
            m = re.match(r"    (\w+): [^#]*#\s*(.*)$", line)
            if m:
                docs[m[1]] = m[2]
    return docs


def render() -> str:
    """The stored schemas' fields as ``key: default  # doc`` lines, one block per schema."""
    out: List[str] = []
    picks: Dict[str, List[str]] = {}  # schema -> the conf/clip options that extend it
    for path in sorted((DOCS.parents[1] / "conf" / "clip").glob("*.yaml")):
        picks.setdefault(str(OmegaConf.load(path).defaults[0]), []).append(path.stem)
    for name, group, cls, node in stored():
        key = {"clip": f"clip={','.join(picks.get(name, ['?']))}", "sampling": "rollout.sampling",
               None: name[:-len("_schema")]}[group]
        out.append(f"{key}: {cls.__name__} (fspo/{inspect.getsourcefile(cls).rsplit('/fspo/', 1)[-1]})")
        out += _field_lines(node, field_docs(cls), "  ")
    return "\n".join(out)


def _field_lines(node: type, docs: Dict[str, str], indent: str) -> List[str]:
    out = []
    for f in fields(node):
        doc = f"  # {docs[f.name]}" if f.name in docs else ""
        if is_dataclass(f.default_factory):  # a nested schema: its fields below
            out += [f"{indent}{f.name}:{doc}", *_field_lines(f.default_factory, field_docs(f.default_factory),
                                                             indent + "  ")]
        elif f.name != "_target_":
            value = "???" if f.default is MISSING else OmegaConf.to_yaml({"v": f.default})[3:].strip()
            out.append(f"{indent}{f.name}: {value}{doc}")
    return out


def docs_page(text: str) -> str:
    """``text`` (docs/configuration.md) with the part between `BEGIN` and `END` rendered anew."""
    head, rest = text.split(BEGIN, 1)
    return f"{head}{BEGIN}\n```yaml\n{render()}\n```\n{END}{rest.split(END, 1)[1]}"


register()
if not OmegaConf.has_resolver("fspo_schema_help"):  # the settings part of run.py's --help
    OmegaConf.register_new_resolver("fspo_schema_help", render)
