"""Command-line conventions shared by the entry points, and the console scripts.

Owns:
- the command-line checks of the entry points (fspo/runtime/checks/command_line.py, re-exported here):
  ``group=x`` == ``+group=x`` (`normalize_group_overrides`), unknown keys named with the closest known key
  (`unknown_key_error`) and values checked before torch loads (`early_error`).
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

import sys
from pathlib import Path
from typing import List

from omegaconf import OmegaConf

from fspo.runtime.checks.command_line import (  # noqa: F401  (the entry points' names)
    CONF_DIR,
    defaults_groups,
    early_error,
    known_top_keys,
    normalize_group_overrides,
    unknown_key_error,
)

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS_DIR = ROOT / "experiments"

# the groups each app reads (help listing); evaluate.py appends model/ like run.py
EVAL_GROUPS = ("eval_data", "model", "reward", "rollout")
EVAL_ONLY_GROUPS = ("eval_data",)


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
