"""What Hydra writes into a run folder that already holds a run, and what a dry run writes at all.

`protect_run_folder(argv)` adds overrides so that ``dry_run=true`` writes nothing (no ``.hydra/``, the log to
the console only), and a launch into a ``hydra.run.dir`` that holds a run's ``.hydra/`` puts its own copy in
``.hydra/launch-<date>-<time>/`` instead of overwriting the run's. A ``hydra.output_subdir`` or
``hydra/job_logging`` the user sets is kept as given.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import List, Optional, Sequence


def _value(argv: Sequence[str], key: str) -> Optional[str]:
    for a in argv:
        k, eq, v = a.lstrip("+").partition("=")
        if eq and k == key:
            return v.strip("'\"")
    return None


def protect_run_folder(argv: Sequence[str]) -> List[str]:
    """``argv`` plus the overrides that protect the run folder."""
    out = list(argv)
    if _value(out, "hydra.output_subdir") is not None:
        return out
    if str(_value(out, "dry_run")).lower() in ("true", "1", "yes", "on"):
        out.append("hydra.output_subdir=null")
        if _value(out, "hydra/job_logging") is None:
            out.append("hydra/job_logging=stdout")
        return out
    run_dir = _value(out, "hydra.run.dir")
    if run_dir and (Path(run_dir).expanduser() / ".hydra" / "config.yaml").is_file():
        out.append(f"hydra.output_subdir=.hydra/launch-{time.strftime('%Y%m%d-%H%M%S')}")
    return out
