"""Command-line keys and values checked against the composed config, before the entry point starts.

Owns: `compose_for_check` (the config Hydra would compose from a command line, through Hydra's compose API:
the groups it selects, and optionally its ``key=value`` overrides too), `nested_key_error` (a dotted key the
composed config does not have, e.g. ``clip.c_uper=0.05`` or ``ppo.mini_batch_sise=8``: one line naming the
closest key of the node it was meant for, which depends on the selected options: the clip rule's keys
differ per rule) and `early_value_error` (config_rules.py `check_values`, before torch is imported).
Each returns one line or None; a command line this module cannot compose is left to Hydra, which reports it as before.
Leaves out: the top-level keys (fspo/cli.py `unknown_key_error` checks those first, from the YAML files) and
the checks of fspo/runtime/checks/config_check.py that need the settings objects or the machine.
"""
from __future__ import annotations

import difflib
import itertools
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, Tuple

from omegaconf import DictConfig

FLAGS_WITH_VALUE = ("--config-name", "-cn", "--config-dir", "-cd", "--config-path", "-cp", "--experimental-rerun")
MAX_COMPOSITIONS = 16  # group sweeps (``+method=fspo,grpo``): each combination composed, up to this many


def _args(argv: Sequence[str]) -> List[str]:
    """``key=value`` arguments: no flags or their values, no ``++``/``~`` forms."""
    skip = {i + 1 for i, a in enumerate(argv) if a in FLAGS_WITH_VALUE}
    return [a for i, a in enumerate(argv) if i not in skip and not a.startswith(("-", "~", "++")) and "=" in a]


def _choices(value: str) -> Optional[List[str]]:
    """The options of a group override's value: ``a`` or ``a,b`` (a sweep); None for sweep functions (glob ...)."""
    if any(c in value for c in "()[]{}*"):
        return None
    return [v.strip() for v in value.split(",")]


def compose_for_check(argv: Sequence[str], name: str, dirs: Sequence[Path], groups: Sequence[str],
                      with_values: bool = False) -> Iterator[DictConfig]:
    """The configs composed from ``argv``'s group selections (one per combination of a group sweep's options),
    with its other ``key=value`` overrides when ``with_values``. ``dirs``: the search folders, the primary
    config's first; ``groups``: the config group names. Nothing when a group is swept by a function."""
    from hydra import compose, initialize_config_dir

    group_args, value_args = [], []
    for a in _args(argv):
        key, _, val = a.partition("=")
        if key.lstrip("+").split("@")[0] in groups:
            opts = _choices(val)
            if opts is None:
                return
            group_args.append([f"{key}={o}" for o in opts])
        elif not key.lstrip("+").startswith("hydra."):
            value_args.append(a)
    search = [f"hydra.searchpath=[{','.join(f'file://{d}' for d in dirs[1:])}]"] if len(dirs) > 1 else []
    combos = list(itertools.islice(itertools.product(*group_args), MAX_COMPOSITIONS))
    with initialize_config_dir(config_dir=str(dirs[0]), version_base="1.3"):
        for combo in combos:
            yield compose(name, overrides=[*search, *combo, *(value_args if with_values else [])])


def _flat_keys(node: DictConfig, prefix: str = "") -> Iterator[str]:
    for k in node.keys():
        child = node._get_node(k)
        path = f"{prefix}{k}"
        yield path
        if isinstance(child, DictConfig) and not child._is_none() and not child._is_interpolation():
            yield from _flat_keys(child, path + ".")


def _missing(cfg: DictConfig, key: str, append: bool, applied: bool = False) -> Optional[Tuple[str, List[str]]]:
    """(the part of ``key`` that ``cfg`` lacks, the closest keys) or None when ``key`` can be set; ``applied``:
    ``cfg`` was composed with the command line's overrides (an appended key is there, beside its siblings)."""
    node, parts = cfg, key.split(".")
    for i, part in enumerate(parts):
        if not isinstance(node, DictConfig) or node._is_none() or node._is_interpolation():
            return None  # a list, null or interpolated node: Hydra's to judge
        if append and i == len(parts) - 1 and (applied or part not in node.keys()):
            # +a.b=v adds a key: refused only one slip away from a key there is
            others = [str(k) for k in node.keys() if str(k) != part]
            close = difflib.get_close_matches(part, others, n=1, cutoff=0.85)
            return (key, [".".join([*parts[:i], close[0]])]) if close else None
        if part not in node.keys():
            if append:
                return None
            here = [".".join([*parts[:i], str(k)]) for k in node.keys()]
            close = difflib.get_close_matches(".".join(parts[:i + 1]), here, n=1, cutoff=0.6)
            if not close:
                close = difflib.get_close_matches(key, list(_flat_keys(cfg)), n=1, cutoff=0.6)
            return key, close or [f"one of {', '.join(here)}"]
        node = node._get_node(part)
    return None


def nested_key_error(argv: Sequence[str], cfgs: Sequence[DictConfig], applied: bool = False) -> Optional[str]:
    """One line for the first dotted ``key=value`` / ``+key=value`` of ``argv`` that none of ``cfgs`` (the
    compositions of `compose_for_check`, ``applied``: with the overrides) has, naming the closest key there;
    None when every key is known."""
    if not cfgs:
        return None
    for a in _args(argv):
        key = a.partition("=")[0]
        append, bare = key.startswith("+"), key.lstrip("+")
        if "." not in bare or bare.startswith("hydra.") or "@" in bare:
            continue
        found = [_missing(c, bare, append, applied) for c in cfgs]
        if any(f is None for f in found):
            continue
        _, close = found[0]
        value = a.partition("=")[2]
        hint = f"did you mean '{close[0]}'? ({close[0]}={value})" if not close[0].startswith("one of ") else \
            f"set {close[0]}"
        return f"unknown config key '{bare}' in '{a}': {hint}"
    return None


def early_value_error(cfg: DictConfig) -> Optional[str]:
    """The first value of ``cfg`` that `check_values` refuses, as one line; None when all pass."""
    from fspo.runtime.checks.config_rules import ConfigError, check_values

    try:
        check_values(cfg)
    except ConfigError as e:
        return str(e)
    return None
