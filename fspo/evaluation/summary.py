"""The best/last summary of an evaluation's checkpoints and its MLflow logging. Per benchmark (paper, "Main
Results") best and last follow best_last.py; the **Average** row is the mean over benchmarks of the best
(resp. last) values, as the paper's "Average (Best/Last)" column. The base model is reported beside them and
never counts as best or last.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Dict, List, Optional

from fspo.evaluation.best_last import best_last
from fspo.tracking.orphans import end_orphans, owner_tags

log = logging.getLogger(__name__)


def summarize(entries: List[Dict[str, Any]], metric: str = "avg_at_k") -> Dict[str, Any]:
    """Best/last summary of ``entries`` (``{"checkpoint", "step", "base", "metrics": {benchmark: {metric: value}}}``):
    ``{"metric", "benchmarks": {name: {"best", "last", "base"}}, "average", "checkpoints"}``."""
    ckpts = [e for e in entries if not e.get("base")]
    base = next((e for e in entries if e.get("base")), None)
    if not ckpts:
        raise ValueError("summarize needs at least one evaluated checkpoint")
    # by step (unknown steps first, in the given order): the last entry is the last checkpoint
    ckpts = [e for _, e in sorted(enumerate(ckpts), key=lambda ie: (ie[1].get("step") is not None,
                                                                    ie[1].get("step") or 0, ie[0]))]
    names = list(dict.fromkeys(b for e in entries for b in e["metrics"]))
    benches: Dict[str, Any] = {}
    for b in names:
        have = [e for e in ckpts if b in e["metrics"]]
        if not have:
            continue
        pick = lambda e, b=b: {"value": e["metrics"][b][metric], "step": e.get("step"),
                          "checkpoint": e.get("checkpoint")}
        i_best, i_last = best_last([e["metrics"][b][metric] for e in have])
        benches[b] = {"best": pick(have[i_best]), "last": pick(have[i_last]),
                      "base": base["metrics"][b][metric] if base and b in base["metrics"] else None}
    avg = lambda key: sum(v[key]["value"] for v in benches.values()) / len(benches)  # noqa: E731
    base_vals = [v["base"] for v in benches.values()]
    return {"metric": metric, "benchmarks": benches,
            "average": {"best": avg("best"), "last": avg("last"),
                        "base": sum(base_vals) / len(base_vals) if base and None not in base_vals else None},
            "checkpoints": ([base] if base else []) + ckpts}


def summary_markdown(summary: Dict[str, Any]) -> str:
    """The summary as Markdown tables, in fractions correct (0-1, 4 decimals)."""
    pct = lambda v: "-" if v is None else f"{v:.4f}"  # noqa: E731
    m, benches = summary["metric"], summary["benchmarks"]
    lines = [f"## {m}: best / last checkpoint (fraction correct, 0-1)", "",
             "| Benchmark | Base | Best | Best step | Last | Last step |",
             "|---|---|---|---|---|---|"]
    for b, v in list(benches.items()) + [("Average", summary["average"])]:
        best, last = (v["best"], v["last"]) if b != "Average" else ({"value": v["best"]}, {"value": v["last"]})
        lines.append(f"| {b} | {pct(v['base'])} | {pct(best['value'])} | {best.get('step', '')} | "
                     f"{pct(last['value'])} | {last.get('step', '')} |")
    lines += ["", f"## {m} per checkpoint (fraction correct, 0-1)", "",
              "| Step | Checkpoint | " + " | ".join(benches) + " | Average |",
              "|---|---|" + "---|" * (len(benches) + 1)]
    for e in summary["checkpoints"]:
        vals = [e["metrics"].get(b, {}).get(m) for b in benches]
        mean = sum(vals) / len(vals) if vals and None not in vals else None
        name = "base model" if e.get("base") else Path(str(e.get("checkpoint"))).name
        lines.append(f"| {e.get('step')} | {name} | " + " | ".join(pct(v) for v in vals) + f" | {pct(mean)} |")
    return "\n".join(lines) + "\n"


class MlflowRecorder:
    """One evaluation's MLflow sink: a new run in ``experiment_name``, or the existing run ``run_id``. Every artifact
    is also written under ``out_dir``."""

    def __init__(self, tracking_uri: str, out_dir, experiment_name: str = "fspo-eval", run_id: Optional[str] = None,
                 run_name: Optional[str] = None, tags: Optional[Dict[str, str]] = None,
                 artifact_location: Optional[str] = None):
        from mlflow import MlflowClient

        self.client, self.out_dir = MlflowClient(tracking_uri), Path(out_dir)
        tags = {str(k): str(v) for k, v in (tags or {}).items()}
        if run_id:
            self.run_id, self.attached = self.client.get_run(run_id).info.run_id, True  # raises if unknown
            for k, v in tags.items():
                self.client.set_tag(self.run_id, k, v)
        else:
            exp = self.client.get_experiment_by_name(experiment_name)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(
                experiment_name, artifact_location=str(artifact_location) if artifact_location else None)
            end_orphans(self.client, exp_id)  # an earlier evaluation killed -9 here is not left RUNNING forever
            self.run_id = self.client.create_run(exp_id, run_name=run_name, tags={**tags, **owner_tags()}).info.run_id
            self.attached = False

    def log_params(self, params: Dict[str, Any]) -> None:
        """Run parameters (new runs only)."""
        if not self.attached:
            from mlflow.entities import Param

            items = [Param(k, str(v)[:6000]) for k, v in params.items()]
            for i in range(0, len(items), 100):
                self.client.log_batch(self.run_id, params=items[i:i + 100])

    def log_metrics(self, metrics: Dict[str, float], step: int) -> None:
        """Scalar metrics at ``step`` (one batch call)."""
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, int(step)) for k, v in metrics.items()])

    def log_json(self, obj: Any, artifact_file: str) -> Path:
        """``obj`` as JSON at ``artifact_file``."""
        return self._log_text(json.dumps(obj, indent=1, default=str), artifact_file)

    def _local(self, artifact_file: str) -> Path:
        """The local copy's path: the artifact path without its leading ``eval/``."""
        return self.out_dir / (artifact_file[len("eval/"):] if artifact_file.startswith("eval/") else artifact_file)

    def _log_text(self, text: str, artifact_file: str) -> Path:
        local = self._local(artifact_file)
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_text(text)
        parent = str(Path(artifact_file).parent)
        self.client.log_artifact(self.run_id, str(local), artifact_path=None if parent == "." else parent)
        return local

    def log_benchmark(self, result, step: Optional[int], checkpoint: Optional[str], folder: str) -> Dict[str, float]:
        """``eval/<name>/<metric>`` at ``step`` (0 when unknown), ``<folder>/per_problem.json`` (MLflow's table format),
        completions when kept, tags ``eval/checkpoint`` / ``eval/step``. Returns the metrics."""
        metrics = result.metrics()
        self.log_metrics({f"eval/{result.name}/{k}": v for k, v in metrics.items()}, step or 0)
        table, artifact = result.table(), f"{folder}/per_problem.json"
        local = self._local(artifact)
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_text(json.dumps({"columns": list(table), "data": [list(r) for r in zip(*table.values())]}))
        self.client.log_table(self.run_id, data=table, artifact_file=artifact)  # same format; a table in the UI
        if result.completions:
            self._log_text("\n".join(json.dumps(c) for c in result.completions) + "\n", f"{folder}/completions.jsonl")
        self.client.set_tag(self.run_id, "eval/checkpoint", str(checkpoint))
        self.client.set_tag(self.run_id, "eval/step", str(step))
        return metrics

    def log_summary(self, summary: Dict[str, Any]) -> None:
        """``eval/summary.{json,md}`` and ``summary/<benchmark>/{best,last}_<metric>`` metrics."""
        m = summary["metric"]
        flat = {f"summary/average/{k}_{m}": v for k, v in summary["average"].items() if v is not None}
        for b, v in summary["benchmarks"].items():
            flat.update({f"summary/{b}/best_{m}": v["best"]["value"], f"summary/{b}/last_{m}": v["last"]["value"]})
            if v["best"]["step"] is not None:
                flat[f"summary/{b}/best_step"] = v["best"]["step"]
        self.log_metrics(flat, step=max((e.get("step") or 0) for e in summary["checkpoints"]))
        self.log_json(summary, "eval/summary.json")
        self._log_text(summary_markdown(summary), "eval/summary.md")

    def close(self, ok: bool = True, status: Optional[str] = None) -> None:
        """End a run this recorder created; an attached run is left as it was."""
        if not self.attached:
            self.client.set_terminated(self.run_id, status or ("FINISHED" if ok else "FAILED"))
