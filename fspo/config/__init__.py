"""The run's typed config: the settings dataclasses stored as schemas in Hydra's ConfigStore, and their docs.

Owns: `register` (run when fspo is imported): ``run_schema`` (the root, fspo/config/groups.py),
``sampling/schema`` and ``clip/<rule>_schema`` (``fspo_calibrated_schema``: with ``calibration``). A value of the
wrong type, or an unknown key where a node is closed, does not compose. `field_docs` (the comment on a field's
line), `render` (``--help``'s typed settings) and `docs_page` (docs/configuration.md's generated part,
``python -m fspo.config``). Imports no torch. Leaves out: value ranges (fspo/runtime/checks/config_rules.py).
"""
from __future__ import annotations

import inspect
import re
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from fspo.clipping.settings import SETTINGS, FSPOSettings
from fspo.config.groups import SAMPLING, EvalModelConfig, RunConfig, schema
from fspo.rollout.settings import SamplingConfig

DOCS = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
BEGIN, END = "<!-- generated from the schemas: python -m fspo.config -->", "<!-- end of generated -->"
FSPO_TARGET = "fspo.clipping.fspo.FSPOClip"


def stored() -> Iterator[Tuple[str, Optional[str], type, type]]:
    """(name, group, settings class, schema) of every stored schema."""
    yield "run_schema", None, RunConfig, RunConfig
    for target, cls in SETTINGS.items():
        yield f"{target.split('.')[2]}_schema", "clip", cls, schema(cls, target, drop=("owner", "calibration"))
    yield "fspo_calibrated_schema", "clip", FSPOSettings, schema(FSPOSettings, FSPO_TARGET)
    yield "schema", "sampling", SamplingConfig, SAMPLING


def register() -> None:
    cs = ConfigStore.instance()
    for name, group, _, node in stored():
        cs.store(name=name, group=group, node=node)
    cs.store(name="eval_model_schema", node=EvalModelConfig)  # evaluate.py's model node


def field_docs(cls: type) -> Dict[str, str]:
    """{field: its one-line doc}: the comment on the field's line in ``cls`` or the base class that states it."""
    docs: Dict[str, str] = {}
    cls = getattr(cls, "__settings__", cls)  # a schema made by `schema`: the docs of its class
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
               None: "the run (root)"}[group]
        out.append(f"{key}: {_origin(cls)}")
        out += _field_lines(node, field_docs(cls), "  ")
    return "\n".join(out)


def _origin(cls: type) -> str:
    """``Name (fspo/<file>)`` of a settings class, or of the one a schema was made from."""
    cls = getattr(cls, "__settings__", cls)
    return f"{cls.__name__} (fspo/{inspect.getsourcefile(cls).rsplit('/fspo/', 1)[-1]})"


def _field_lines(node: type, docs: Dict[str, str], indent: str) -> List[str]:
    out = []
    for f in fields(node):
        doc = f"  # {docs[f.name]}" if f.name in docs else ""
        if is_dataclass(f.default_factory):  # a nested schema: its fields below
            out += [f"{indent}{f.name}: {_origin(f.default_factory)}{doc}",
                    *_field_lines(f.default_factory, field_docs(f.default_factory), indent + "  ")]
        elif f.name != "_target_":
            default = f.default_factory() if f.default_factory is not MISSING else f.default
            value = "???" if default is MISSING else OmegaConf.to_yaml({"v": default})[3:].strip()
            out.append(f"{indent}{f.name}: {value}{doc}")
    return out


def docs_page(text: str) -> str:
    """``text`` (docs/configuration.md) with the part between `BEGIN` and `END` rendered anew."""
    head, rest = text.split(BEGIN, 1)
    return f"{head}{BEGIN}\n```yaml\n{render()}\n```\n{END}{rest.split(END, 1)[1]}"


register()
if not OmegaConf.has_resolver("fspo_schema_help"):  # the settings part of run.py's --help
    OmegaConf.register_new_resolver("fspo_schema_help", render)
