"""Report over MLflow runs: the paper's Table 1, length-fairness summary and figures.

    python experiments/report.py --experiment methods --out reports/methods
    python experiments/report.py --experiment methods --experiment rloo_wide --out reports/rloo_wide
    python experiments/report.py --experiment fspo_c --group-by c --out reports/fspo_c
    python experiments/report.py --filter "tags.sweep = 'methods' and tags.model = 'tiny'" --out reports/x
    python experiments/report.py --experiment methods --eval-run <evaluate run id> --out reports/methods

Writes ``--out`` (table1.md/.csv, fairness.csv, runs.csv, report.md, figures/, qq/), logged as the artifacts
of a run named ``report`` in the (first) experiment; ``--eval-run`` adds Figure 4 (difficulty.csv). Errors (no
such experiment, no matching run) end with one line and exit code 2.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from fspo.evaluation.report.build import make_report
from fspo.runtime.checks.console import quiet_artifact_downloads


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tracking-uri", default=os.environ.get("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db"))
    p.add_argument("--experiment", action="append", default=[], help="experiment name (repeatable)")
    p.add_argument("--filter", default="", help="MLflow search filter, e.g. \"tags.sweep = 'methods'\"")
    p.add_argument("--group-by", default="method", help="comma-separated tags/params to group by (method, c, z, ...)")
    p.add_argument("--out", type=Path, required=True, help="output folder")
    p.add_argument("--include-unfinished", action="store_true", help="also RUNNING / FAILED / KILLED runs")
    p.add_argument("--no-log", action="store_true", help="do not log the report to MLflow")
    p.add_argument("--title", default="FSPO report")
    p.add_argument("--eval-run", action="append", default=[], help="evaluate run id for Figure 4 (repeatable)")
    p.add_argument("--min-bin-count", type=float, default=100.0,
                   help="sequences per run a length bin needs to count for the flatness column (default 100)")
    return p.parse_args(argv)


def _round(v) -> str:
    """A figure for a person: 4 significant digits, '-' for none."""
    return "-" if v is None else f"{float(v):.4g}"


def flatness_text(rows, group) -> str:
    """The group's max - min of c(L), rounded, or why there is none (fewer than 2 bins thick enough)."""
    row = next((r for r in rows if r["group"] == group), None)
    if row is None or row.get("flatness") is None:
        n = 0 if row is None else row.get("n_populated") or 0
        return f"- (too few bins: {n} of the 2 needed)"
    return _round(row["flatness"])


def main(argv=None) -> int:
    """Build the report; prints where it went and the Table 1 / LRE numbers."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    quiet_artifact_downloads()  # no per-run download bars in a log (fspo/runtime/checks/console.py)
    statuses = ("FINISHED", "RUNNING", "FAILED", "KILLED") if args.include_unfinished else ("FINISHED",)
    try:
        if args.eval_run:  # first: the report run then logs it with the rest of the folder
            from fspo.evaluation.report.difficulty import write_difficulty
            print(f"Figure 4: {write_difficulty(args.tracking_uri, args.eval_run, args.out)}")
        res = make_report(args.tracking_uri, args.out, args.experiment, args.filter,
                          [k.strip() for k in args.group_by.split(",") if k.strip()], statuses,
                          log_to_mlflow=not args.no_log, title=args.title, min_bin_count=args.min_bin_count)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print((args.out / "table1.md").read_text())
    for row in res["fairness"]:
        print(f"LRE {row['group']}: {_round(row['lre'])}  (c(L) max - min over bins with >= {args.min_bin_count:g} "
              f"sequences a run: {flatness_text(res['by_length'], row['group'])})")
    run = f"; MLflow report run {res['report_run_id']}" if res["report_run_id"] else ""
    print(f"{res['n_runs']} runs -> {args.out}{run}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
