"""Which classes and functions a config read from a file (not typed by this launch) may name.

Every importable string of a stored config (each ``_target_``, and each ``check`` as ``module:function``) is
checked AFTER resolving its interpolations, so a target assembled from ``${...}`` pieces is checked as what
Hydra would build; an interpolation may call only `SAFE_RESOLVERS` (none builds a class or runs code). Allowed:
a class or function DEFINED in fspo (``fspo.runtime.checkpoints.integrity.os.system`` resolves to ``os.system``
and is refused), `ALLOWED_TARGETS` (the Lightning Trainer and loggers), and what this launch's own config names.
Anything else is refused, before anything is built, with one line naming the key, the value and the file.
"""
from __future__ import annotations

from typing import Any, Iterator, Optional, Sequence, Set, Tuple

from omegaconf import DictConfig, ListConfig, OmegaConf

ALLOWED_TARGETS = frozenset({
    "lightning.Trainer", "lightning.pytorch.Trainer",
    "lightning.pytorch.loggers.MLFlowLogger", "lightning.pytorch.loggers.CSVLogger",
    "lightning.pytorch.loggers.TensorBoardLogger", "lightning.pytorch.loggers.WandbLogger",
})
# resolvers a stored interpolation may call: none of them builds a class or runs code
SAFE_RESOLVERS = frozenset({"oc.env", "oc.decode", "oc.select", "now", "fspo_launch_id"})
# key -> separator of module and name in its value
IMPORTABLE_KEYS = {"_target_": ".", "check": ":"}


class UntrustedTarget(ValueError):
    """A stored config names a class or function outside the allow-list, or calls an unsafe resolver."""


def _resolver_names(text: str) -> Set[str]:
    """The resolvers ``text`` (a string holding ``${...}``) calls, nested ones included."""
    from omegaconf import grammar_parser
    from omegaconf.grammar.gen.OmegaConfGrammarParser import OmegaConfGrammarParser as P

    names: Set[str] = set()

    def walk(t: Any) -> None:
        if isinstance(t, P.ResolverNameContext):
            names.add(t.getText())
        for c in (t.getChildren() if hasattr(t, "getChildren") else ()):
            walk(c)

    walk(grammar_parser.parse(text))
    return names


def _refuse_unsafe_interpolation(key: str, raw: str, source: str) -> None:
    try:
        bad = sorted(_resolver_names(raw) - SAFE_RESOLVERS)
    except Exception:  # noqa: BLE001 - a string the grammar cannot read is not resolved either
        bad = ["(unreadable interpolation)"]
    if bad:
        raise UntrustedTarget(
            f"{key}={raw!r} in the stored config ({source}) calls {', '.join(bad)}: a stored config may interpolate "
            f"keys and {', '.join(sorted(SAFE_RESOLVERS))} only -- refused, nothing was resolved or built. If you "
            f"wrote that config and trust it, pass {key}=<value> on the command line")


def _importables(node: Any, source: str, prefix: str = "",
                 only: Optional[Sequence[str]] = None) -> Iterator[Tuple[str, str, str]]:
    """(dotted key, importable string, separator) of ``node`` (its keys ``only``), interpolations checked first."""
    if isinstance(node, DictConfig):
        items = [(k, f"{prefix}.{k}" if prefix else str(k)) for k in node.keys() if only is None or k in only]
    elif isinstance(node, ListConfig):
        items = [(i, f"{prefix}[{i}]") for i in range(len(node))]
    else:
        return
    for k, key in items:
        child = node._get_node(k)
        if child is None:
            continue
        value: Any = child
        if child._is_interpolation():
            raw = str(child._value())
            _refuse_unsafe_interpolation(key, raw, source)
            try:
                value = node[k]
            except Exception as e:  # noqa: BLE001 - what does not resolve cannot be checked
                raise UntrustedTarget(f"{key}={raw!r} in the stored config ({source}) does not resolve "
                                      f"({type(e).__name__}): refused, nothing was built") from None
        elif not isinstance(child, (DictConfig, ListConfig)):
            value = child._value()
        if isinstance(value, (dict, list)):
            value = OmegaConf.create(value)
        if isinstance(value, (DictConfig, ListConfig)):
            yield from _importables(value, source, key)
        elif str(k) in IMPORTABLE_KEYS and isinstance(value, str):
            yield key, value, IMPORTABLE_KEYS[str(k)]


def _defined_in_fspo(target: str, sep: str = ".") -> bool:
    """True when ``target`` starts with ``fspo.`` and resolves to a class or function defined in fspo."""
    dotted = target.replace(":", ".", 1) if sep == ":" and target.count(":") == 1 else target
    if not dotted.startswith("fspo.") or any(not part.isidentifier() for part in dotted.split(".")):
        return False
    from hydra.utils import get_object

    try:
        obj = get_object(dotted)  # imports fspo modules only: the name starts with fspo.
    except Exception:  # noqa: BLE001 - a name that does not resolve is not allowed
        return False
    return str(getattr(obj, "__module__", "") or "").split(".")[0] == "fspo" and callable(obj)


def _own(trusted: Optional[DictConfig]) -> Set[str]:
    """Every raw importable string of this launch's config (the user's: allowed as given)."""
    own: Set[str] = set()

    def walk(node: Any) -> None:
        keys = list(node.keys()) if isinstance(node, DictConfig) else range(len(node)) if isinstance(
            node, ListConfig) else []
        for k in keys:
            child = node._get_node(k)
            if isinstance(child, (DictConfig, ListConfig)):
                walk(child)
            elif child is not None and str(k) in IMPORTABLE_KEYS:
                own.add(str(child._value()))

    if trusted is not None:
        walk(trusted)
    return own


def check_stored_targets(stored: DictConfig, source: str, trusted: Optional[DictConfig] = None,
                         keys: Optional[Sequence[str]] = None) -> None:
    """Raise `UntrustedTarget` unless every importable string in ``stored`` is allowed and every interpolation
    safe; ``trusted``: this launch's own config; ``keys``: check only these top-level subtrees."""
    own = _own(trusted)
    for key, target, sep in _importables(stored, source, only=keys):
        if target in own or (sep == "." and target in ALLOWED_TARGETS) or _defined_in_fspo(target, sep):
            continue
        raise UntrustedTarget(
            f"{key}={target} in the stored config ({source}) is not on the allow-list of what a stored config "
            f"may build or import (fspo's own, the Lightning trainer and loggers, and what this command line "
            f"names): refused, nothing was built. If you wrote that config and trust it, pass {key}={target} on "
            f"the command line")
