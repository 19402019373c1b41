"""The command that continues a run, as printed by its stop lines.

Pasted into a shell, the command continues the run that printed it: the same entry point and working directory
(``cd <cwd> &&`` keeps the config's relative paths, such as ``sqlite:///mlflow.db``, where the run wrote) and
the run's folder as ``hydra.run.dir=`` (Hydra's run folder) or ``output_dir=``; the run's saved config restores
every other setting.
"""
from __future__ import annotations

import contextlib
import re
import shlex
import sys
from pathlib import Path
from typing import Optional, Sequence

_PLAIN = re.compile(r"^[\w/.\-+@~%]+$")


def hydra_quote(value: str) -> str:
    """``value`` as a Hydra override value: as is when plain, else in single quotes (``'`` and ``\\`` escaped)."""
    if _PLAIN.match(value):
        return value
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _hydra_run_dir() -> Optional[Path]:
    with contextlib.suppress(Exception):  # no Hydra run (a config built in code)
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            return Path(HydraConfig.get().runtime.output_dir).resolve()
    return None


def continue_command(output_dir, argv: Optional[Sequence[str]] = None, cwd: Optional[Path] = None,
                     hydra_run_dir: Optional[bool] = None) -> str:
    """The shell command that continues the run in ``output_dir``; ``hydra_run_dir``: name the folder as
    ``hydra.run.dir`` (None: when it is this process's Hydra run folder)."""
    argv = list(sys.argv if argv is None else argv)
    prog = argv[0] if argv and argv[0] else "experiments/run.py"
    if Path(prog).name.startswith("fspo-"):
        head = Path(prog).name
    elif prog.endswith(".py"):
        head = f"python {shlex.quote(prog)}"
    else:  # python -c / an interpreter embedding train(): the documented entry point
        head = "python experiments/run.py"
    out = Path(output_dir).resolve()
    if hydra_run_dir is None:
        hydra_run_dir = _hydra_run_dir() == out
    key = "hydra.run.dir" if hydra_run_dir else "output_dir"
    where = Path.cwd() if cwd is None else Path(cwd)
    return f"cd {shlex.quote(str(where))} && {head} {shlex.quote(f'{key}={hydra_quote(str(out))}')} resume=auto"


def _progress(run: Path) -> Optional[tuple]:
    """(last checkpoint step or 0, the run's steps) of a run folder holding ``run_config.yaml``, else None."""
    from fspo.runtime.checkpoints.files import checkpoint_dir, list_checkpoints

    try:
        import yaml

        steps = int((yaml.safe_load((run / "run_config.yaml").read_text()) or {}).get("steps"))
        ckpts = list_checkpoints(checkpoint_dir(run)) if checkpoint_dir(run).is_dir() else []
    except Exception:  # noqa: BLE001 - not a readable run folder: not a candidate
        return None
    return (int(ckpts[-1].stem.split("_")[1]) if ckpts else 0), steps


def newest_interrupted_run(root, exclude=None) -> Optional[tuple]:
    """(folder, last checkpoint step, steps) of the newest run under ``root`` (``<root>/<date>/<time>``) that
    stopped before its last step, or None; ``exclude``: this launch's own folder."""
    root, found = Path(root), []
    skip = Path(exclude).resolve() if exclude is not None else None
    for cfg in root.glob("*/*/run_config.yaml"):
        run = cfg.parent
        got = None if run.resolve() == skip else _progress(run)
        if got is not None and got[0] < got[1]:
            found.append((cfg.stat().st_mtime, run, *got))
    if not found:
        return None
    _, run, step, steps = max(found, key=lambda t: t[0])
    return run, step, steps


def fresh_folder_resume_error(output_dir, argv: Optional[Sequence[str]] = None) -> str:
    """The one line for ``resume=auto`` in a new run folder, naming the newest interrupted run beside it."""
    out = Path(output_dir)
    root = out.parent.parent
    hit = newest_interrupted_run(root, exclude=out)
    head = (f"resume=auto continues the run in its output folder, but this launch's folder {out} is new (neither "
            f"hydra.run.dir nor output_dir was given)")
    if hit is None:
        return (f"{head} and no interrupted run was found under {root}: pass hydra.run.dir=<the run's folder> "
                f"resume=auto, or leave resume=auto out to start a new run")
    run, step, steps = hit
    return (f"{head}; the newest interrupted run is {run} (stopped at step {step} of {steps}): continue it with: "
            f"{continue_command(run, argv, hydra_run_dir=True)}")
