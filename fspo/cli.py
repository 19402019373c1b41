"""Command-line conventions shared by the entry points, and the console scripts.

Owns:
- `normalize_group_overrides`: ``group=option`` and ``+group=option`` both work for every config
  group. Hydra accepts ``group=x`` only for groups in the primary config's defaults list and
  ``+group=x`` only for the others (method/, model/, experiment/, arm/ are appended, see
  conf/config.yaml), and a defaults entry cannot make both forms compose; so the entry points
  rewrite the command line to the form Hydra expects before Hydra parses it.
- the ``fspo_launch_id`` resolver (`launch_id`): the default run folder's suffix, unique per launch.
- the ``fspo_help_groups`` resolver used by each app's ``hydra.help.template``: the config groups that
  app reads, with their options (run.py does not list eval_data/, evaluate.py lists only its groups).
- the console scripts of pyproject.toml: ``fspo-train``, ``fspo-eval`` and ``fspo-report`` run
  experiments/run.py, experiments/evaluate.py and experiments/report.py from this checkout, exactly as
  ``python experiments/<file>.py`` does (same Hydra app, config folder and job name).
Leaves out: what the entry points do (experiments/*.py, fspo/train.py).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional, Sequence, Set

from omegaconf import OmegaConf

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
