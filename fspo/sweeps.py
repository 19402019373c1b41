"""The sweep configs in ``sweeps/``: list them and expand one into its jobs, as Hydra would.

`sweep_jobs` gives the override lists Hydra's basic sweeper launches for ``python experiments/run.py -m
--config-dir sweeps --config-name <name> [overrides]``, `job_config` one job's composed config. To preview:

    python -m fspo.sweeps                       # every sweep and its jobs
    python -m fspo.sweeps methods seed=1,2      # one sweep, with command-line overrides
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List, Sequence

from omegaconf import DictConfig

ROOT = Path(__file__).resolve().parents[1]
SWEEPS_DIR = ROOT / "sweeps"
CONF_DIR = ROOT / "conf"


def list_sweeps(sweeps_dir: Path = SWEEPS_DIR) -> List[str]:
    """Names of the sweep configs: ``sweeps/*.yaml`` except files starting with ``_`` (shared parts)."""
    return sorted(p.stem for p in Path(sweeps_dir).glob("*.yaml") if not p.stem.startswith("_"))


def list_arms(sweeps_dir: Path = SWEEPS_DIR) -> List[str]:
    """Names of the sweep arms: ``sweeps/arm/*.yaml``, each a method plus its own settings (``+arm=<name>``)."""
    return sorted(p.stem for p in (Path(sweeps_dir) / "arm").glob("*.yaml"))


def _compose(name: str, overrides: Sequence[str], return_hydra_config: bool) -> DictConfig:
    """Compose sweep ``name`` the way the CLI does: sweeps/ holds the primary config, conf/ is searched too."""
    from hydra import compose, initialize_config_dir

    if name not in list_sweeps():
        raise ValueError(f"unknown sweep {name!r}: choose one of {list_sweeps()} (files in {SWEEPS_DIR})")
    with initialize_config_dir(config_dir=str(SWEEPS_DIR), version_base="1.3"):
        return compose(config_name=name, overrides=[f"hydra.searchpath=[file://{CONF_DIR}]", *overrides],
                       return_hydra_config=return_hydra_config)


def sweep_jobs(name: str, overrides: Sequence[str] = ()) -> List[List[str]]:
    """The jobs of sweep ``name``: one list of override strings per job, in launch order.

    ``hydra.sweeper.params`` of the sweep, then ``overrides`` (command-line style; a key given
    there replaces the sweep's values, e.g. ``seed=1,2``, and ``hydra.sweeper.params.*`` keys
    edit the grid), expanded into the cartesian product by Hydra's own BasicSweeper code.
    """
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    hydra_over = [o for o in overrides if o.lstrip("+~").startswith("hydra.")]
    task_over = [o for o in overrides if o not in hydra_over]
    cfg = _compose(name, hydra_over, return_hydra_config=True)
    params = cfg.hydra.sweeper.params or {}
    args = [f"{k}={v}" for k, v in params.items()] + task_over
    parsed = OverridesParser.create().parse_overrides(args)
    return [list(job) for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def job_config(name: str, job_overrides: Sequence[str]) -> DictConfig:
    """The task config (no ``hydra`` node) one job of sweep ``name`` runs with; interpolations unresolved."""
    return _compose(name, list(job_overrides), return_hydra_config=False)


def main(argv: Sequence[str]) -> int:
    """CLI: print the jobs of one sweep (``name [overrides]``) or of every sweep; ``-h``: usage."""
    parser = argparse.ArgumentParser(
        prog="python -m fspo.sweeps", description="Preview Hydra sweeps: print the jobs (override lists) that "
        "`python experiments/run.py -m --config-dir sweeps --config-name NAME [OVERRIDE ...]` would launch. Without "
        "NAME: every sweep in sweeps/ and its jobs.")
    parser.add_argument("name", nargs="?", metavar="NAME", help=f"a sweep: {', '.join(list_sweeps())}")
    parser.add_argument("overrides", nargs="*", metavar="OVERRIDE", help="command-line overrides as for run.py "
                        "(seed=1,2 replaces the sweep's seeds; +arm=a,b runs the arms a and b of a length sweep, "
                        f"from sweeps/arm/: {', '.join(list_arms())})")
    if any(a in ("-h", "--help") for a in argv):
        parser.print_help()
        return 0
    if argv and argv[0] not in list_sweeps():
        print(f"error: unknown sweep {argv[0]!r}: choose one of {list_sweeps()} (files in {SWEEPS_DIR}); "
              f"see --help", file=sys.stderr)
        return 2
    names = [argv[0]] if argv else list_sweeps()
    for n in names:
        over = list(argv[1:]) if argv else []
        if over:  # method=x and +method=x both work, as with run.py
            from fspo.cli import normalize_group_overrides

            over = normalize_group_overrides(["--config-dir", str(SWEEPS_DIR), "--config-name", n, *over])[4:]
        jobs = sweep_jobs(n, over)
        print(f"{n}: {len(jobs)} jobs")
        for i, j in enumerate(jobs):
            print(f"  #{i} {' '.join(j)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
