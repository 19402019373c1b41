"""Which ``_target_`` a config read from a file (not typed by this launch) may name.

Owns: `check_stored_targets` (every ``_target_`` of a stored config -- a checkpoint's run config on
``resume``, ``run_config.yaml``, ``.hydra/config.yaml`` or an MLflow ``config.yaml`` read by evaluate.py --
must be on the allow-list before Hydra instantiates anything from it), `ALLOWED_TARGETS` and
`UntrustedTarget`. Leaves out: reading those files (fspo/runtime/checks/run_config.py, experiments/evaluate.py).

The allow-list: (a) a class or function DEFINED in fspo (the name starts with ``fspo.`` and the object it
resolves to has ``__module__`` under ``fspo``: ``fspo.runtime.checkpoints.integrity.os.system`` resolves
to ``os.system`` and is refused); (b) the third-party classes conf/ names (`ALLOWED_TARGETS`: the
Lightning Trainer and loggers); (c) any target this launch's own config names (the command line and
conf/ are the user's; a custom reward class they pass keeps working on resume). Anything else is
refused with one line naming the key, the target and the file.
"""
from __future__ import annotations

from typing import Any, Iterator, Optional, Set, Tuple

from omegaconf import DictConfig, ListConfig

ALLOWED_TARGETS = frozenset({
    "lightning.Trainer", "lightning.pytorch.Trainer",
    "lightning.pytorch.loggers.MLFlowLogger", "lightning.pytorch.loggers.CSVLogger",
    "lightning.pytorch.loggers.TensorBoardLogger", "lightning.pytorch.loggers.WandbLogger",
})


class UntrustedTarget(ValueError):
    """A stored config names a ``_target_`` outside the allow-list."""


def _targets(node: Any, prefix: str = "") -> Iterator[Tuple[str, str]]:
    """(dotted key, target) of every ``_target_`` in ``node``, read without resolving interpolations."""
    if isinstance(node, DictConfig):
        for k in node.keys():
            child = node._get_node(k)
            key = f"{prefix}.{k}" if prefix else str(k)
            if k == "_target_":
                yield key, str(child._value())
            elif isinstance(child, (DictConfig, ListConfig)):
                yield from _targets(child, key)
    elif isinstance(node, ListConfig):
        for i in range(len(node)):
            child = node._get_node(i)
            if isinstance(child, (DictConfig, ListConfig)):
                yield from _targets(child, f"{prefix}[{i}]")


def _defined_in_fspo(target: str) -> bool:
    """True when ``target`` starts with ``fspo.`` and resolves to a class or function defined in fspo."""
    if not target.startswith("fspo.") or any(not part.isidentifier() for part in target.split(".")):
        return False
    from hydra.utils import get_object

    try:
        obj = get_object(target)  # imports fspo modules only: the name starts with fspo.
    except Exception:  # noqa: BLE001 - a name that does not resolve is not allowed
        return False
    return str(getattr(obj, "__module__", "") or "").split(".")[0] == "fspo" and callable(obj)


def check_stored_targets(stored: DictConfig, source: str, trusted: Optional[DictConfig] = None) -> None:
    """Raise `UntrustedTarget` unless every ``_target_`` in ``stored`` (read from ``source``) is allowed
    (module docstring); ``trusted``: this launch's own config, whose targets are allowed as given."""
    own: Set[str] = {t for _, t in _targets(trusted)} if trusted is not None else set()
    for key, target in _targets(stored):
        if target in ALLOWED_TARGETS or target in own or _defined_in_fspo(target):
            continue
        raise UntrustedTarget(
            f"{key}={target} in the stored config ({source}) is not on the allow-list of classes a stored config "
            f"may build (fspo's own, the Lightning trainer and loggers, and the targets this command line names): "
            f"refused, nothing was built. If you wrote that config and trust it, pass {key}={target} on the "
            f"command line")

