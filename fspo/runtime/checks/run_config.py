"""The run's own config on resume: a continued run keeps the config it was started with.

Owns: `resume_config` (the config a launch runs with: the command line's for a new run; the run's
saved config for a continued one, with the allowed changes of this command line applied),
`save_run_config` (``<output_dir>/run_config.yaml``), `RESUMABLE` (the allow-list) and
`ConfigChangedOnResume`. Leaves out: choosing the checkpoint (fspo/runtime/checkpoints/resume.py) and storing the config
in checkpoints (fspo/runtime/checkpoints/checkpointing.py, ``fspo_resume.run_config``).

Contract, for a continued run (a checkpoint or an MLflow run to continue):
- the saved config is the one in the checkpoint resumed from, else ``run_config.yaml`` (a run killed
  before its first checkpoint); a checkpoint of an older version without either is resumed with
  the command line's config as given, with a warning;
- a key the command line did not set keeps its saved value, so ``resume=auto`` alone continues
  the same experiment; keys the saved config lacks (added by a newer version) take their default;
- a key the command line sets to a new value must be in `RESUMABLE` (run length, logging,
  checkpointing, threads); any other change (batch, method, model, data, seed, ...) stops the
  launch before anything loads, with one line listing every such key;
- ``output_dir`` and ``resume`` always take this launch's values; ``steps`` may not go below the
  checkpoint's step;
- the allowed changes are returned in ``plan.overrides`` (fspo/runtime/checkpoints/resume.py records them as MLflow
  tags, params being immutable) and the effective config is written back to ``run_config.yaml``.
``overrides`` are this launch's command-line overrides (Hydra's ``overrides.task``); None (a
config built in code) counts every difference as set by the caller.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from fspo.runtime.checkpoints.files import read_resume_meta
from fspo.runtime.checkpoints.stored_config import check_stored_targets
from fspo.runtime.launch.rank_zero import launch_rank

log = logging.getLogger(__name__)
RUN_CONFIG_FILE = "run_config.yaml"
# keys (and their subtrees) a continued run may change: they do not change what is trained
RESUMABLE = ("steps", "run_name", "tags", "logger", "extra_loggers", "logger_fallback", "cpu_threads", "checkpoint",
             "val.every_n_steps", "trainer.log_every_n_steps", "trainer.enable_progress_bar", "progress")
ALWAYS_CURRENT = ("output_dir", "resume")  # where and how this launch runs
_ABSENT = object()
Path_ = Tuple[str, ...]


class ConfigChangedOnResume(ValueError):
    """The command line changes a key of a continued run's config that is not in `RESUMABLE`."""


def _flatten(node: Any, prefix: Path_ = ()) -> Dict[Path_, Any]:
    """{key path: leaf} of a plain container; lists and empty dicts are leaves."""
    if isinstance(node, dict) and node:
        out: Dict[Path_, Any] = {}
        for k, v in node.items():
            out.update(_flatten(v, prefix + (str(k),)))
        return out
    return {prefix: node}


def _override_paths(overrides: Sequence[str]) -> List[Path_]:
    """Key paths set by command-line overrides (``a.b=x``, ``+a=x``, ``++a=x``, ``~a``, group ``a/b=x``);
    Hydra's own keys are left out."""
    out = []
    for o in overrides:
        key = str(o).split("=", 1)[0].lstrip("+~").strip()
        if key and not key.startswith(("hydra.", "hydra/")) and key != "hydra":
            out.append(tuple(key.replace("/", ".").split("@")[0].split(".")))
    return out


def _covers(a: Path_, b: Path_) -> bool:
    n = min(len(a), len(b))
    return a[:n] == b[:n]


def _dotted(p: Path_) -> str:
    return ".".join(p)


def _set(cfg: DictConfig, path: Path_, value: Any) -> None:
    """Set (or, for ``_ABSENT``, delete) the key at ``path``, creating parent nodes as needed."""
    node = cfg
    with open_dict(cfg):
        for k in path[:-1]:
            if k not in node or not isinstance(node[k], DictConfig):
                node[k] = {}
            node = node[k]
        if value is _ABSENT:
            node.pop(path[-1], None)
        else:
            node[path[-1]] = value


# Config targets of classes that moved when fspo/ was grouped into packages (update/, runtime/, tracking/),
# then runtime/ into launch/, checkpoints/, checks/: a run saved before keeps its config on resume, with
# these names read as the new ones.
LEGACY_TARGETS = {
    "fspo.runtime.distributed.FSDP2Strategy": "fspo.runtime.launch.distributed.FSDP2Strategy",
    "fspo.runtime.run_lock.LockOutputDir": "fspo.runtime.checks.run_lock.LockOutputDir",
    "fspo.module.PPOConfig": "fspo.update.settings.PPOConfig",
    "fspo.guard.DivergenceGuard": "fspo.update.guard.DivergenceGuard",
    "fspo.distributed.FSDP2Strategy": "fspo.runtime.launch.distributed.FSDP2Strategy",
    "fspo.run_lock.LockOutputDir": "fspo.runtime.checks.run_lock.LockOutputDir",
    "fspo.hydra_callbacks.MLflowSweepParent": "fspo.tracking.sweep_parent.MLflowSweepParent",
}


def upgrade_legacy_targets(node: Any) -> int:
    """Rewrite, in place, every ``_target_`` of a saved config that names a moved class (`LEGACY_TARGETS`);
    returns how many were rewritten."""
    n = 0
    keys = (list(node.keys()) if isinstance(node, DictConfig) else range(len(node)) if isinstance(node, ListConfig)
            else [])
    for k in keys:
        child = node._get_node(k)
        if isinstance(child, (DictConfig, ListConfig)):
            n += upgrade_legacy_targets(child)
        elif k == "_target_" and child._value() in LEGACY_TARGETS:
            node[k] = LEGACY_TARGETS[child._value()]
            n += 1
    return n


def saved_run_config(ckpt_path: Optional[str], output_dir) -> Tuple[Optional[str], str]:
    """(the saved config as YAML or None, where it came from): the checkpoint's, else run_config.yaml."""
    if ckpt_path is not None:
        text = read_resume_meta(ckpt_path).get("run_config")
        if text:
            return text, f"checkpoint {Path(ckpt_path).name}"
    f = Path(output_dir) / RUN_CONFIG_FILE
    if f.is_file():
        return f.read_text(), str(f)
    return None, ""


def save_run_config(cfg: DictConfig, output_dir) -> None:
    """Write ``cfg`` (unresolved) to ``<output_dir>/run_config.yaml`` atomically, on the launching process."""
    if launch_rank() != 0:
        return
    f = Path(output_dir) / RUN_CONFIG_FILE
    tmp = f.with_name(f.name + ".tmp")
    tmp.write_text(OmegaConf.to_yaml(cfg))
    os.replace(tmp, f)


def resume_config(cfg: DictConfig, plan, output_dir, overrides: Optional[Sequence[str]] = None) -> DictConfig:
    """The config this launch runs with (module docstring); fills ``plan.overrides``. Raises
    `ConfigChangedOnResume` before anything is loaded or written when the command line changes the
    experiment of a continued run."""
    earlier = (str(OmegaConf.select(cfg, "resume", default=None)) == "auto"
               and (Path(output_dir) / RUN_CONFIG_FILE).is_file())
    if not plan.resuming and not earlier:  # (earlier: an attempt that died before its MLflow run existed)
        save_run_config(cfg, output_dir)
        return cfg
    text, source = saved_run_config(plan.ckpt_path, output_dir)
    if text is None:
        log.warning("resume: no saved config for this run (written by an older version): running with this command "
                    "line's config as given -- check that it matches the run's")
        return cfg
    try:
        saved = OmegaConf.create(text)
        if not isinstance(saved, DictConfig):
            raise ValueError(f"a {type(saved).__name__}, not a mapping of settings")
    except Exception as e:  # noqa: BLE001 - a damaged or hand-edited file: one line, nothing overwritten
        raise ValueError(f"resume: the run's saved config ({source}) is not a readable config "
                         f"({type(e).__name__}: {str(e).splitlines()[0][:160]}): repair it, or start a new run in "
                         f"another output_dir") from None
    if upgrade_legacy_targets(saved):
        log.info("resume: the saved config names classes by their paths before fspo/ was regrouped; "
                 "read as the new ones")
    check_stored_targets(saved, source, trusted=cfg)  # a stored _target_ builds only allow-listed classes
    old = _flatten(OmegaConf.to_container(saved, resolve=False))
    new = _flatten(OmegaConf.to_container(cfg, resolve=False))
    explicit = None if overrides is None else _override_paths(overrides)
    result = saved
    refused, allowed, restored = [], {}, []
    # nodes whose class differs (the run's saved ``clip`` is SAPO's, this command line's default FSPO's):
    # the new class's extra keys are not "keys added by a newer version" and must not reach the saved one
    swapped = [k[:-1] for k in old if k[-1] == "_target_" and k in new and old[k] != new[k]]
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k, _ABSENT), new.get(k, _ABSENT)
        if a == b:
            continue
        change = f"{'(unset)' if a is _ABSENT else a} -> {'(unset)' if b is _ABSENT else b}"
        if any(_covers(k, c) for c in map(lambda s: tuple(s.split(".")), ALWAYS_CURRENT)):
            _set(result, k, b)
        elif a is _ABSENT and any(_covers(s, k) for s in swapped) and (
                explicit is None or not any(_covers(k, e) for e in explicit)):
            restored.append(f"{_dotted(k)} ({b} -> (unset): the run's {_dotted(k[:-1]) or 'node'} is another class)")
        elif a is _ABSENT and (explicit is None or not any(_covers(k, e) for e in explicit)):
            _set(result, k, b)  # a key newer than the run's config: its default
        elif explicit is not None and not any(_covers(k, e) for e in explicit):
            restored.append(f"{_dotted(k)} ({b if b is not _ABSENT else '(unset)'} -> {a})")
        elif any(_covers(k, tuple(r.split("."))) for r in RESUMABLE):
            _set(result, k, b)
            allowed[_dotted(k)] = change
        else:
            refused.append(f"{_dotted(k)} {change}")
    if refused:
        raise ConfigChangedOnResume(
            f"resume: this command line changes the run's saved config ({source}): {'; '.join(refused)}. A continued "
            f"run keeps its batch, method, model, data and seed: drop these overrides (resume=auto alone restores the "
            f"saved config) or start a new run in another output_dir; changeable on resume: {', '.join(RESUMABLE)}")
    steps = OmegaConf.select(result, "steps")
    if steps is not None and int(steps) < int(plan.step):
        raise ConfigChangedOnResume(f"resume: steps={steps} is below the checkpoint's step {plan.step}: pass "
                                    f"steps >= {plan.step} (or leave steps out to keep the run's)")
    if restored:
        log.info("resume: %d keys keep the run's saved value (%s), not this command line's default: %s", len(restored),
                 source, ", ".join(restored[:12]) + (" ..." if len(restored) > 12 else ""))
    if allowed:
        log.warning("resume: changed on this launch (recorded as MLflow tags fspo.resume.*): %s",
                    ", ".join(f"{k} {v}" for k, v in allowed.items()))
    plan.overrides = allowed
    OmegaConf.set_struct(result, OmegaConf.is_struct(cfg))
    save_run_config(result, output_dir)
    return result
