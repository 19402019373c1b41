"""Where the results went: the few lines printed at the end of a training run, a sweep and an evaluation.

A file / SQLite store is opened with ``mlflow ui --backend-store-uri <absolute uri>`` (so the command works
from any folder); every URL carries ``?workflowType=machine_learning``, without which MLflow 3.x opens the
GenAI view.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

RULE = "-" * 72


def _is_path(u: str) -> bool:
    """A plain path (MLflow's file store), not a scheme URI nor ``databricks`` / ``databricks-uc``."""
    return bool(u) and "://" not in u and not u.startswith(("databricks", "uc:"))


def absolute_uri(uri: Optional[str]) -> Optional[str]:
    """``uri`` with a relative SQLite or file path made absolute (against the current folder)."""
    if not uri:
        return uri
    u = str(uri)
    if u.startswith("sqlite:///") and not u.startswith("sqlite:////"):
        return "sqlite:///" + str(Path(u[len("sqlite:///"):]).resolve())
    if u.startswith("file:") or _is_path(u):
        path = u[len("file://"):] if u.startswith("file://") else u[len("file:"):] if u.startswith("file:") else u
        return Path(path).resolve().as_uri()
    return u


UI_URL = "http://127.0.0.1:5000"  # where ``mlflow ui`` serves by default
ML_VIEW = "workflowType=machine_learning"  # MLflow 3.x opens an experiment on its GenAI (traces) view without it


def open_rows(uri: Optional[str], experiment_id: Optional[str] = None,
              run_id: Optional[str] = None) -> List[Tuple[str, str]]:
    """How to open the results, as (label, text) rows: for a local store the ``mlflow ui`` command, then the
    experiment and run URLs (on ``mlflow ui``'s default address or on the http(s) server) where ids are known."""
    u = str(uri or "")
    if u.startswith(("http://", "https://")):
        base, rows = u.rstrip("/"), []
    elif u.startswith(("sqlite:", "file:")) or _is_path(u):
        base, rows = UI_URL, [("open with", f"mlflow ui --backend-store-uri {absolute_uri(u)}")]
    else:
        return [("tracking URI", u or "(none)")]
    if experiment_id is not None:  # the runs list, then the run's charts, in MLflow's "Model training" view
        rows.append(("experiment page", f"{base}/#/experiments/{experiment_id}/runs?{ML_VIEW}"))
        if run_id:
            rows.append(("run page", f"{base}/#/experiments/{experiment_id}/runs/{run_id}/model-metrics?{ML_VIEW}"))
    return rows or [("MLflow server", base)]


def format_block(title: str, rows: Iterable[Tuple[str, Any]]) -> str:
    """``title`` between two rules, one ``label: value`` line per row (rows with value None are left out)."""
    rows = [(k, v) for k, v in rows if v is not None]
    width = max((len(k) for k, _ in rows), default=0)
    return "\n".join([RULE, title, *(f"  {k + ':':<{width + 1}} {v}" for k, v in rows), RULE])


def _results(metrics: Optional[Mapping[str, float]], prefix: Tuple[str, ...] = ("val/",)) -> Optional[str]:
    keep = {k: v for k, v in (metrics or {}).items() if k.startswith(prefix)}
    if not keep:
        return None
    return ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in sorted(keep.items()))


def _progress(start: Optional[float], end: Optional[float], steps: Optional[Tuple[int, int]]) -> Optional[str]:
    if end is None:
        return None
    span = f" (step {steps[0]} -> {steps[1]})" if steps else ""
    return f"{start:.3f} -> {end:.3f}{span}" if start is not None else f"{end:.3f}"


def training_summary(output_dir, checkpoint_dir, tracking_uri: Optional[str], experiment_name: Optional[str],
                     experiment_id: Optional[str], run_name: Optional[str], run_id: Optional[str],
                     metrics: Optional[Mapping[str, float]] = None, start_accuracy: Optional[float] = None,
                     steps: Optional[Tuple[int, int]] = None, run_lre: Optional[float] = None) -> str:
    """The block a training run ends on: where everything is, accuracy ``start -> end``, LRE, how to open it."""
    end_acc = (metrics or {}).get("val/accuracy")
    exp = (f"{experiment_name} (id {experiment_id})" if experiment_name and experiment_id is not None
           else experiment_name)
    run = f"{run_name} (id {run_id})" if run_name and run_id else run_id
    return format_block(f"run {run_name or run_id or ''} finished".replace("  ", " "), [
        ("output dir", str(Path(output_dir).resolve())),
        ("checkpoints", str(Path(checkpoint_dir).resolve())),
        ("tracking URI", absolute_uri(tracking_uri)),
        ("experiment", exp),
        ("run", run),
        ("held-out acc", _progress(start_accuracy, end_acc, steps)),
        ("run LRE", f"{run_lre:.4f}" if run_lre is not None else None),
        ("results", _results(metrics)),
        *open_rows(tracking_uri, experiment_id, run_id)])


def sweep_summary(sweep: str, sweep_dir: Optional[str], tracking_uri: Optional[str], experiment_name: Optional[str],
                  experiment_id: Optional[str], parent_name: Optional[str], parent_id: Optional[str],
                  jobs_ok: int, jobs_failed: int, status: str, group_by: str = "method") -> str:
    """The block a sweep (Hydra multirun) ends on; its report command groups runs by ``group_by``."""
    return format_block(f"sweep {sweep} {status.lower()}: {jobs_ok} jobs finished, {jobs_failed} failed", [
        ("sweep dir", str(Path(sweep_dir).resolve()) if sweep_dir else None),
        ("tracking URI", absolute_uri(tracking_uri)),
        ("experiment", f"{experiment_name} (id {experiment_id})" if experiment_id is not None else experiment_name),
        ("parent run", f"{parent_name} (id {parent_id})" if parent_name else parent_id),
        *open_rows(tracking_uri, experiment_id, None),
        ("report", f"python experiments/report.py --experiment {experiment_name} --group-by {group_by} "
                   f"--out reports/{experiment_name}" if experiment_name else None)])


def eval_summary(output_dir, tracking_uri: Optional[str], experiment_name: Optional[str],
                 experiment_id: Optional[str], run_name: Optional[str], run_id: Optional[str],
                 entries: Optional[list] = None, summary_md: Optional[Path] = None) -> str:
    """The block an evaluation ends on: where ``summary.md`` went and the last target's Avg@k."""
    results: Dict[str, float] = {}
    if entries:
        results = {f"{b}/avg_at_k": float(m["avg_at_k"]) for b, m in entries[-1]["metrics"].items()}
    return format_block(f"evaluation {run_name or run_id or ''} finished".replace("  ", " "), [
        ("output dir", str(Path(output_dir).resolve())),
        ("summary", str(Path(summary_md).resolve()) if summary_md is not None and Path(summary_md).exists() else None),
        ("tracking URI", absolute_uri(tracking_uri)),
        ("experiment", f"{experiment_name} (id {experiment_id})" if experiment_id is not None else experiment_name),
        ("run", f"{run_name} (id {run_id})" if run_name and run_id else run_id),
        ("results", _results(results, ("",))),
        *open_rows(tracking_uri, experiment_id, run_id)])
