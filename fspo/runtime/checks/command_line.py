"""The command line checked before the entry point starts: group selections in the form Hydra accepts, unknown
keys named with the closest known key, and the values set on the command line.

Owns:
- `normalize_group_overrides`: ``group=option`` and ``+group=option`` both work for every config
  group. Hydra accepts ``group=x`` only for groups in the primary config's defaults list and
  ``+group=x`` only for the others (method/, model/, experiment/, arm/ are appended, see
  conf/config.yaml), and a defaults entry cannot make both forms compose; so the entry points
  rewrite the command line to the form Hydra expects before Hydra parses it.
- `unknown_key_error`: a key the config does not have (``stpes=5``, ``+stpes=5``, ``clip.c_uper=0.05``) is
  refused before Hydra starts, with the closest known key (Hydra itself rejects ``stpes=5`` but suggests
  ``+stpes=5``, which it then accepts silently and the default run starts); top-level keys from the YAML
  files, nested keys against the composed config (config_keys.py).
- `early_error` (run.py): that, then the values set on the command line checked before torch loads
  (config_keys.py `early_value_error`).
Leaves out: the entry points themselves (experiments/*.py; fspo/cli.py re-exports these for them).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import List, Optional, Sequence, Set

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

from fspo.runtime.checks.config_keys import (
    FLAGS_WITH_VALUE,
    _args,
    compose_for_check,
    early_value_error,
    nested_key_error,
)
from fspo.runtime.checks.method_aliases import legacy_forms

CONF_DIR = Path(__file__).resolve().parents[3] / "conf"


# -- group=option / +group=option -------------------------------------------------------------
def _yaml(name: str, dirs: Sequence[Path]) -> Optional[Path]:
    for d in dirs:
        p = Path(d) / f"{name}.yaml"
        if p.is_file():
            return p
    return None


def _defaults(path: Path) -> list:
    try:
        node = OmegaConf.load(path)
    except Exception:  # noqa: BLE001 - an unreadable file: Hydra reports it itself
        return []
    d = node.get("defaults") if OmegaConf.is_dict(node) else None
    return list(OmegaConf.to_container(d)) if d is not None else []


def defaults_groups(config_name: str, dirs: Sequence[Path], _seen: Optional[Set[Path]] = None) -> Set[str]:
    """Config groups that have an entry (not an ``override``) in the defaults list of ``config_name``,
    following plain config entries (``- config``, ``- _base``) through ``dirs``."""
    seen = _seen if _seen is not None else set()
    path = _yaml(config_name, dirs)
    if path is None or path in seen:
        return set()
    seen.add(path)
    groups: Set[str] = set()
    for entry in _defaults(path):
        if isinstance(entry, str):
            if entry != "_self_":
                groups |= defaults_groups(entry.lstrip("/"), dirs, seen)
        elif isinstance(entry, dict):
            for key in entry:
                k = str(key).strip()
                if k.startswith("override "):
                    continue
                k = k.replace("optional ", "").strip().lstrip("/").split("@")[0]
                groups.add(k)
    return groups


def _option_groups(group: str, option: str, dirs: Sequence[Path]) -> Set[str]:
    """Groups that option ``group/option`` adds to the defaults list (e.g. an experiment's ``/model``)."""
    groups: Set[str] = set()
    for d in dirs:
        p = Path(d) / group / f"{option}.yaml"
        if p.is_file():
            for entry in _defaults(p):
                if isinstance(entry, dict):
                    for key in entry:
                        k = str(key).strip()
                        if k.startswith("/") and not k.startswith("override"):
                            groups.add(k.lstrip("/").split("@")[0])
    return groups


def _config_location(argv: Sequence[str], config_name: str, conf_dir: Path = CONF_DIR) -> tuple[str, List[Path]]:
    """(primary config name, search folders) from ``--config-name/-cn``, ``--config-dir/-cd`` and ``conf_dir``."""
    name, extra = config_name, []
    it = list(argv)
    for i, a in enumerate(it):
        for flags, setter in ((("--config-name", "-cn"), "name"), (("--config-dir", "-cd"), "dir")):
            val = None
            for f in flags:
                if a == f and i + 1 < len(it):
                    val = it[i + 1]
                elif a.startswith(f + "="):
                    val = a[len(f) + 1:]
            if val is not None:
                if setter == "name":
                    name = val
                else:
                    extra.append(Path(val).expanduser().resolve())
    dirs = [*extra, CONF_DIR]
    return name, dirs + ([] if conf_dir in dirs else [conf_dir])


def normalize_group_overrides(argv: Sequence[str], config_name: str = "config",
                              conf_dir: Path = CONF_DIR) -> List[str]:
    """``argv`` with every config-group selection in the form Hydra accepts: ``group=x`` becomes
    ``+group=x`` when the primary config's defaults list has no ``group`` entry, and ``+group=x``
    becomes ``group=x`` when it has one. Other arguments (keys, flags, ``++``/``~`` forms) pass as they are."""
    argv = legacy_forms(argv)  # clip=<rule>, +arm=<arm> without --config-dir: deprecated, composing as before
    name, dirs = _config_location(argv, config_name, conf_dir)
    present = defaults_groups(name, dirs)
    flag_values = {i + 1 for i, a in enumerate(argv) if a in FLAGS_WITH_VALUE}
    groups = {p.name for d in dirs if d.is_dir() for p in d.iterdir()
              if p.is_dir() and not p.name.startswith((".", "_"))}

    def parse(a: str):
        if a.startswith(("-", "~", "++")) or "=" not in a:
            return None
        key, _, val = a.partition("=")
        plus = key.startswith("+")
        key = key.lstrip("+")
        return (key, val, plus) if key in groups else None

    for i, a in enumerate(argv):  # groups that selected options add (an experiment's /model entry)
        p = None if i in flag_values else parse(a)
        if p is not None and "," not in p[1]:
            present |= _option_groups(p[0], p[1], dirs)
    out = []
    for i, a in enumerate(argv):
        p = None if i in flag_values else parse(a)
        if p is None:
            out.append(a)
            continue
        key, val, plus = p
        out.append(f"{key}={val}" if key in present else f"+{key}={val}")
    return out


# -- unknown top-level keys --------------------------------------------------------------------
def _top_keys(path: Path) -> Set[str]:
    try:
        node = OmegaConf.load(path)
    except Exception:  # noqa: BLE001 - an unreadable file: Hydra reports it itself
        return set()
    return {str(k) for k in node.keys() if k != "defaults"} if OmegaConf.is_dict(node) else set()


def known_top_keys(config_name: str, dirs: Sequence[Path]) -> Set[str]:
    """Top-level keys a command line may set: those of the primary config and the configs its defaults list
    includes by name (``- _base``), of every ``@package _global_`` option (method/, experiment/, arm/ ...),
    the config group names, and ``hydra``."""
    keys: Set[str] = {"hydra"}
    seen: Set[Path] = set()
    todo = [config_name]
    while todo:
        name = todo.pop().lstrip("/")
        path = _yaml(name, dirs)
        if path is None:  # a schema stored in Hydra's ConfigStore (fspo/config): the key it fills
            stored = ConfigStore.instance().repo.get(f"{name}.yaml")
            keys |= {str(k) for k in stored.node.keys()} if stored is not None else set()
        if path is None or path in seen:
            continue
        seen.add(path)
        keys |= _top_keys(path)
        todo += [e for e in _defaults(path) if isinstance(e, str) and e != "_self_"]
    for d in dirs:
        if not Path(d).is_dir():
            continue
        for g in Path(d).iterdir():
            if g.is_dir() and not g.name.startswith((".", "_")):
                keys.add(g.name)
                for f in g.glob("*.yaml"):
                    if f.read_text(errors="replace").lstrip().startswith("# @package _global_"):
                        keys |= _top_keys(f)
    return keys


def unknown_key_error(argv: Sequence[str], config_name: str = "config", conf_dir: Path = CONF_DIR) -> Optional[str]:
    """One line for the first ``key=value`` / ``+key=value`` whose key the config does not have (``stpes=5``,
    ``+stpes=5``; a dotted key against the config the command line composes: ``clip.c_uper=0.05``), naming the
    closest known key; None when every key is known. Hydra would
    reject ``stpes=5`` with advice to append ``+stpes=5``, which it then accepts silently, so the typo
    runs the default. ``++key=`` (force-add), ``~key`` and flags pass unchecked."""
    import difflib

    name, dirs = _config_location(argv, config_name, conf_dir)
    known = None
    for a in _args(argv):
        key = a.partition("=")[0].lstrip("+").split(".")[0].split("@")[0]
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            continue
        known = known if known is not None else known_top_keys(name, dirs)
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
            hint = f"did you mean '{close[0]}'? ({a.lstrip('+').replace(key, close[0], 1)})" if close else \
                "run with --help to list the keys"
            return f"unknown config key '{key}' in '{a}': {hint}"
    if not any("." in a.partition("=")[0] for a in _key_args(argv)):
        return None
    return nested_key_error(argv, _compositions(argv, name, dirs))


def _key_args(argv: Sequence[str]) -> List[str]:
    return [a for a in argv if "=" in a and not a.startswith(("-", "~", "++", "hydra.", "+hydra."))]


def _compositions(argv: Sequence[str], name: str, dirs: Sequence[Path], with_values: bool = False,
                  errors: Optional[list] = None) -> list:
    """The configs Hydra would compose from ``argv`` (fspo/runtime/checks/config_keys.py), [] when it cannot
    (the reason appended to ``errors``)."""
    groups = {p.name for d in dirs if Path(d).is_dir() for p in Path(d).iterdir() if p.is_dir()}
    try:
        return list(compose_for_check(normalize_group_overrides(argv, name, dirs[-1]), name, dirs, sorted(groups),
                                      with_values))
    except Exception as e:  # noqa: BLE001 - a command line that does not compose: Hydra reports it as before
        (errors if errors is not None else []).append(e)
        return []


def _type_error(errors: list) -> Optional[str]:
    """A value of the wrong type for its schema (``clip.c_upper=abc``) as one line, else None."""
    cause = errors[0].__cause__ if errors else None
    if not isinstance(cause, ValidationError):
        return None
    return f"{str(errors[0]).split()[-1]}: {str(cause).splitlines()[0]}; --help lists each typed key with its default"


def early_error(argv: Sequence[str], config_name: str = "config", conf_dir: Path = CONF_DIR) -> Optional[str]:
    """`unknown_key_error`, then the values (`early_value_error`: ``clip.c_upper=-1``) on the config composed
    once: a typo or a value out of range never starts a run. A sweep (``-m``): its keys only."""
    argv = legacy_forms(argv)
    if {"-m", "--multirun"} & set(argv) or not _key_args(argv):
        return unknown_key_error(argv, config_name, conf_dir)
    if (top := unknown_key_error([a for a in argv if "." not in a.partition("=")[0]], config_name, conf_dir)):
        return top
    name, dirs = _config_location(argv, config_name, conf_dir)
    errors: list = []
    cfgs = _compositions(argv, name, dirs, with_values=True, errors=errors)
    if not cfgs:  # a key Hydra cannot set: the closest one named; a wrong type; else Hydra's own message
        return unknown_key_error(argv, config_name, conf_dir) or _type_error(errors)
    return nested_key_error(argv, cfgs, applied=True) or _values(cfgs[0])


def _values(cfg) -> Optional[str]:
    """`early_value_error`, or None where it cannot judge (an interpolation that does not resolve yet, ...):
    the run's own check reports that, as before."""
    try:
        return early_value_error(cfg)
    except Exception:  # noqa: BLE001 - left to check_config at the start of the run
        return None
