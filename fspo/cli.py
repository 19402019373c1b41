"""Command-line conventions shared by the entry points, and the console scripts.

Owns:
- `normalize_group_overrides`: ``group=option`` and ``+group=option`` both work for every config
  group. Hydra accepts ``group=x`` only for groups in the primary config's defaults list and
  ``+group=x`` only for the others (method/, model/, experiment/, arm/ are appended, see
  conf/config.yaml), and a defaults entry cannot make both forms compose; so the entry points
  rewrite the command line to the form Hydra expects before Hydra parses it.
- `unknown_key_error`: a top-level key the config does not have (``stpes=5``, ``+stpes=5``) is refused
  before Hydra starts, with the closest known key (Hydra itself rejects ``stpes=5`` but suggests
  ``+stpes=5``, which it then accepts silently and the default run starts).
- the ``fspo_launch_id`` resolver (`launch_id`): the default run folder's suffix, unique per launch.
- the ``fspo_help_groups`` resolver used by each app's ``hydra.help.template``: the config groups that
  app reads, with their options (run.py does not list eval_data/, evaluate.py lists only its groups).
- the console scripts of pyproject.toml: ``fspo-train``, ``fspo-eval``, ``fspo-report``, ``fspo-warmstart``
  and ``fspo-export-lora`` run experiments/run.py, evaluate.py, report.py, warmstart.py and export_lora.py
  from this checkout, exactly as ``python experiments/<file>.py`` does (same Hydra app, config folder and
  job name); ``fspo-export`` (any checkpoint -> a Hugging Face folder) is fspo/runtime/checkpoints/hf_export.py.
Leaves out: what the entry points do (experiments/*.py, fspo/train.py).
"""
from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import List, Optional, Sequence, Set

from omegaconf import OmegaConf

from fspo.runtime.checks.config_keys import compose_for_check, early_value_error, nested_key_error

ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = ROOT / "conf"
EXPERIMENTS_DIR = ROOT / "experiments"

# the groups each app reads (help listing); evaluate.py appends model/ like run.py
EVAL_GROUPS = ("eval_data", "model", "reward", "rollout")
EVAL_ONLY_GROUPS = ("eval_data",)


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


def _config_location(argv: Sequence[str], config_name: str) -> tuple[str, List[Path]]:
    """(primary config name, search folders) from Hydra's ``--config-name/-cn`` and ``--config-dir/-cd``."""
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
    return name, [*extra, CONF_DIR]


def normalize_group_overrides(argv: Sequence[str], config_name: str = "config",
                              conf_dir: Path = CONF_DIR) -> List[str]:
    """``argv`` with every config-group selection in the form Hydra accepts: ``group=x`` becomes
    ``+group=x`` when the primary config's defaults list has no ``group`` entry, and ``+group=x``
    becomes ``group=x`` when it has one. Other arguments (keys, flags, ``++``/``~`` forms) pass as they are."""
    name, dirs = _config_location(argv, config_name)
    if conf_dir not in dirs:
        dirs.append(conf_dir)
    present = defaults_groups(name, dirs)
    flag_values = {i + 1 for i, a in enumerate(argv) if a in ("--config-name", "-cn", "--config-dir", "-cd",
                                                              "--config-path", "-cp", "--experimental-rerun")}
    groups = {p.name for d in dirs if d.is_dir() for p in d.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))}

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
        path = _yaml(todo.pop().lstrip("/"), dirs)
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
    """One line for the first ``key=value`` / ``+key=value`` whose top-level key the config does not have
    (``stpes=5``, ``+stpes=5``), naming the closest known key; None when every key is known. Hydra would
    reject ``stpes=5`` with advice to append ``+stpes=5``, which it then accepts silently, so the typo
    runs the default. ``++key=`` (force-add), ``~key`` and flags pass unchecked."""
    import difflib

    name, dirs = _config_location(argv, config_name)
    if conf_dir not in dirs:
        dirs.append(conf_dir)
    known = None
    skip = {i + 1 for i, a in enumerate(argv) if a in ("--config-name", "-cn", "--config-dir", "-cd",
                                                       "--config-path", "-cp", "--experimental-rerun")}
    for i, a in enumerate(argv):
        if i in skip or a.startswith(("-", "~", "++")) or "=" not in a:
            continue
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


def _compositions(argv: Sequence[str], name: str, dirs: Sequence[Path], with_values: bool = False) -> list:
    """The configs Hydra would compose from ``argv`` (fspo/runtime/checks/config_keys.py), [] when it cannot."""
    groups = {p.name for d in dirs if Path(d).is_dir() for p in Path(d).iterdir() if p.is_dir()}
    try:
        return list(compose_for_check(normalize_group_overrides(argv, name, dirs[-1]), name, dirs, sorted(groups),
                                      with_values))
    except Exception:  # noqa: BLE001 - a command line that does not compose: Hydra reports it as before
        return []


def early_error(argv: Sequence[str], config_name: str = "config", conf_dir: Path = CONF_DIR) -> Optional[str]:
    """`unknown_key_error` and then `value_error`, composing the config once where the command line composes
    (the entry point's first check: a typo or a value out of range never starts a run)."""
    if {"-m", "--multirun"} & set(argv) or not _key_args(argv):
        return unknown_key_error(argv, config_name, conf_dir)
    if (top := unknown_key_error([a for a in argv if "." not in a.partition("=")[0]], config_name, conf_dir)):
        return top
    name, dirs = _config_location(argv, config_name)
    if conf_dir not in dirs:
        dirs.append(conf_dir)
    cfgs = _compositions(argv, name, dirs, with_values=True)
    if not cfgs:  # a key Hydra cannot set: the closest one named (or Hydra's own message)
        return unknown_key_error(argv, config_name, conf_dir)
    return nested_key_error(argv, cfgs, applied=True) or early_value_error(cfgs[0])


def value_error(argv: Sequence[str], config_name: str = "config", conf_dir: Path = CONF_DIR) -> Optional[str]:
    """One line for the first value of ``argv``'s ``key=value`` overrides that the up-front rules refuse
    (`early_value_error`: ``clip.c_upper=-1``), before torch loads; None when they pass, when ``argv`` sets
    no key or runs a sweep (``-m``: each job is checked when it starts)."""
    if not _key_args(argv) or {"-m", "--multirun"} & set(argv):
        return None
    name, dirs = _config_location(argv, config_name)
    if conf_dir not in dirs:
        dirs.append(conf_dir)
    cfgs = _compositions(argv, name, dirs, with_values=True)
    return early_value_error(cfgs[0]) if cfgs else None


# -- help ---------------------------------------------------------------------------------------
def help_groups(app: str) -> str:
    """The ``group: options`` lines of ``app``'s config groups (``config``: run.py, ``evaluate``: evaluate.py)."""
    dirs = sorted(p for p in CONF_DIR.iterdir() if p.is_dir())
    names = [p.name for p in dirs]
    keep = [n for n in names if (n in EVAL_GROUPS if app == "evaluate" else n not in EVAL_ONLY_GROUPS)]
    return "\n".join(f"{n}: {', '.join(sorted(q.stem for q in (CONF_DIR / n).glob('*.yaml')))}" for n in keep)


if not OmegaConf.has_resolver("fspo_help_groups"):
    OmegaConf.register_new_resolver("fspo_help_groups", help_groups)


# -- default run folders ------------------------------------------------------------------------
_LAUNCH_ID: List[str] = []


def launch_id() -> str:
    """A short id of this launch, the same on every rank of one launch, for the default run folders
    (``outputs/<date>/<time>-<id>``, conf/config.yaml) so that two runs started in the same second get
    two folders: the SLURM job id, else torchrun's rendezvous id (``--rdzv-id``), else, under torchrun
    on one node, the launcher's pid (every local rank's parent), else 6 random hex digits. Fixed
    for the life of the process (Hydra resolves the run folder more than once)."""
    import os
    import secrets

    if not _LAUNCH_ID:
        env = os.environ
        rdzv = env.get("TORCHELASTIC_RUN_ID", "")
        _LAUNCH_ID.append(f"j{env['SLURM_JOB_ID']}" if env.get("SLURM_JOB_ID") else
                          rdzv if rdzv and rdzv != "none" else
                          f"p{os.getppid()}" if "LOCAL_RANK" in env and "TORCHELASTIC_RUN_ID" in env else
                          secrets.token_hex(3))
    return _LAUNCH_ID[0]


if not OmegaConf.has_resolver("fspo_launch_id"):
    OmegaConf.register_new_resolver("fspo_launch_id", launch_id)


# -- console scripts ----------------------------------------------------------------------------
def _run_script(script: str) -> None:
    """Run experiments/<script>.py as ``python experiments/<script>.py`` would (``__main__``, argv[0] the
    file: Hydra finds ../conf and names the job after the file; the script normalizes the overrides)."""
    import runpy

    path = EXPERIMENTS_DIR / f"{script}.py"
    if not path.is_file():
        raise SystemExit(f"error: {path} not found: the console scripts run the scripts of a checkout "
                         f"(pip install -e .)")
    sys.argv = [str(path), *sys.argv[1:]]
    runpy.run_path(str(path), run_name="__main__")


def train() -> None:
    """``fspo-train [overrides]``: ``python experiments/run.py [overrides]``."""
    _run_script("run")


def evaluate() -> None:
    """``fspo-eval [overrides]``: ``python experiments/evaluate.py [overrides]``."""
    _run_script("evaluate")


def report() -> None:
    """``fspo-report [options]``: ``python experiments/report.py [options]``."""
    _run_script("report")


def warmstart() -> None:
    """``fspo-warmstart [options]``: ``python experiments/warmstart.py [options]``."""
    _run_script("warmstart")


def export_lora() -> None:
    """``fspo-export-lora CHECKPOINT OUT_DIR [--model-path BASE]``: ``python experiments/export_lora.py ...``."""
    _run_script("export_lora")


def export() -> None:
    """``fspo-export CHECKPOINT OUT_DIR [--model-path BASE] [--dtype D]``: fspo/runtime/checkpoints/hf_export.py."""
    from fspo.runtime.checkpoints.hf_export import main
    raise SystemExit(main())
