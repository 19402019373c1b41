"""`make_report`: the report folder (tables, by-length and length-law views, figures, the runs' Q-Q plots) from
MLflow runs, logged as artifacts of a run tagged ``fspo.role = report`` in its own experiment.
"""
from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Dict, List, Sequence

from fspo.evaluation.report import figures as F
from fspo.evaluation.report.by_length import MIN_COUNT, by_length_markdown, by_length_rows
from fspo.evaluation.report.collect import ROLE_TAG, RunRecord, load_runs, read_artifact
from fspo.evaluation.report.law import law_markdown, law_rows
from fspo.evaluation.report.law_lab import download_records, lab_figure, lab_markdown, lab_rows, own_band, targets
from fspo.evaluation.report.scatter import write_scatter
from fspo.evaluation.report.table import (
    fairness_markdown,
    fairness_rows,
    group_runs,
    run_rows,
    seeds_markdown,
    table1,
    table1_markdown,
    write_csv,
)

log = logging.getLogger(__name__)
LAB_MIN_COUNT = 50  # sequences a length bin needs in the length-law lab's tests
QQ_ARTIFACT = "plots/logratio_qq.png"


REPORT_EXPERIMENT = "fspo-reports"  # report runs live here, outside the training runs' experiments


def metric_key(s: str) -> str:
    """An MLflow-safe metric name (letters, digits, ``_ - . / : space``)."""
    return re.sub(r"[^A-Za-z0-9_\-./: ]", "_", s)


def _download_qq(tracking_uri: str, runs: Dict[str, List[RunRecord]], out: Path) -> Dict[str, Path]:
    """Fetch each run's Q-Q plot into ``out``; runs without one are skipped (logged)."""
    out.mkdir(parents=True, exist_ok=True)
    got: Dict[str, Path] = {}
    for g, rs in runs.items():
        for r in rs:
            dst = out / f"{F.safe_name(g)}_seed{r.value('seed')}_{r.run_id[:8]}.png"
            copy = lambda p, dst=dst: dst.write_bytes(p.read_bytes())  # noqa: E731
            if read_artifact(tracking_uri, r, QQ_ARTIFACT, copy) is not None:
                got[f"{g} seed {r.value('seed')}"] = dst
    return got


def _save(figs: Dict[str, object], folder: Path) -> List[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, fig in figs.items():
        p = folder / f"{name}.png"
        fig.savefig(p)
        paths.append(p)
    return paths


def _markdown(title: str, source: str, records: Sequence[RunRecord], benches, t1_md: str, fair_md: str,
              seeds_md: str, length_md: str, fig_paths: Sequence[Path], out: Path) -> str:
    figs = "\n".join(f"![{p.stem}]({p.relative_to(out).as_posix()})" for p in fig_paths)
    return (f"# {title}\n\n{source}\n\n{len(records)} runs. Best = max over a run's logged history, "
            f"last = the value at its final step; each cell is the mean over the group's runs (seeds).\n\n"
            f"## Table 1: {', '.join(benches) or 'no validation metric logged'}\n\n{t1_md}\n"
            f"## Across seeds (mean +- sample std over the group's runs)\n\n{seeds_md}\n"
            f"## Length fairness (run-level diagnostics, mean over runs)\n\n{fair_md}\n"
            f"## Out-of-band fraction c(L) = 1 - q(L) by response length (mean over runs; n = sequences per run; "
            f"thin bins in parentheses)\n\n{length_md}\n## Figures\n\n{figs}\n")


def make_report(tracking_uri: str, out: Path, experiments: Sequence[str] = (), filter_string: str = "",
                group_by: Sequence[str] = ("method",), statuses: Sequence[str] = ("FINISHED",),
                log_to_mlflow: bool = True, title: str = "FSPO report",
                min_bin_count: float = MIN_COUNT) -> Dict[str, object]:
    """Write the report for the runs matching ``experiments`` / ``filter_string`` into ``out`` (``min_bin_count``:
    sequences per run a length bin needs to count for flatness). Returns ``{"out", "n_runs", "groups", "table1",
    "fairness", "by_length", "report_run_id"}``; ValueError, saying what was searched, when no run matches."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    records = load_runs(client, experiments, filter_string, statuses)
    if not records:
        raise ValueError(f"no {'/'.join(statuses)} training runs in experiments {list(experiments) or 'all'} "
                         f"with filter {filter_string!r} at {tracking_uri}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    groups = group_runs(records, group_by)
    # Lightning marks a run FINISHED after its first validate(); a finished job has run-level metrics
    incomplete = [r.name for r in records if not any(k.startswith("run/") for k in r.metrics)]
    if incomplete:
        log.warning("runs without run-level diagnostics (still running, or ended early?): %s", incomplete)

    benches, t1 = table1(groups)
    fair = fairness_rows(groups)
    write_csv(t1, out / "table1.csv")
    write_csv(fair, out / "fairness.csv")
    write_csv(run_rows(records, group_by), out / "runs.csv")
    t1_md, fair_md = table1_markdown(benches, t1), fairness_markdown(fair)
    (out / "table1.md").write_text(t1_md)
    seeds_md = seeds_markdown(t1, fair, benches[0]) if benches else seeds_markdown(t1, fair)
    by_len = by_length_rows(groups, min_bin_count)
    length_md = by_length_markdown(by_len, min_bin_count)
    (out / "by_length.md").write_text(length_md)
    law = law_rows(groups, min_count=min_bin_count)  # the length law's targets: law.md, law.csv
    write_csv(law, out / "law.csv")
    (out / "law.md").write_text(law_markdown(law))

    figs = F.clip_by_length_figures(groups)
    seq_records = download_records(tracking_uri, groups, out / "records")
    if seq_records:  # the length-law lab: CIs, tests and the sweep's targets
        own = {g: own_band(rs[0]) for g, rs in groups.items()}
        rows = lab_rows(seq_records, min_count=LAB_MIN_COUNT, own_bands=own)
        lab_md = lab_markdown(rows, targets(rows))
        (out / "law_lab.md").write_text(lab_md)
        length_md += "\n## The length law, per sequence (law_lab.md)\n\n" + lab_md
        figs["length_law"] = lab_figure(rows, title)
    figs["clip_fraction_by_length_grid"] = F.clip_by_length_grid(groups, min_bin_count)
    figs["logratio_std_vs_sqrt_len"] = F.std_vs_sqrt_len_figure(groups)
    figs["lre"] = F.lre_figure(groups)
    figs["learning_curves"] = F.learning_curves_figure(groups)
    figs["overlong_rate"] = F.overlong_figure(groups)
    sl = write_scatter(tracking_uri, groups, {g: F.group_sigma(rs) for g, rs in groups.items()}, out)
    if sl is not None:  # Figure 1 (left)
        figs["sl_scatter"] = sl
    qq = _download_qq(tracking_uri, groups, out / "qq")
    figs["logratio_qq_grid"] = F.image_grid_figure(qq, "Q-Q plots of standardised S_L (per run)")
    fig_paths = _save(figs, out / "figures")

    source = (f"Experiments: {', '.join(experiments) or 'all'}; filter: `{filter_string or '-'}`; "
              f"grouped by {', '.join(group_by)}.")
    if incomplete:
        source += f"\n\n**Warning**: runs without run-level diagnostics (still running?): {', '.join(incomplete)}."
    (out / "report.md").write_text(_markdown(title, source, records, benches, t1_md, fair_md, seeds_md, length_md,
                                                  fig_paths, out))

    run_id = None
    if log_to_mlflow:
        exp = client.get_experiment_by_name(REPORT_EXPERIMENT)  # its own experiment: not a row among the runs
        exp_id = exp.experiment_id if exp is not None else client.create_experiment(REPORT_EXPERIMENT)
        name = f"report-{'+'.join(experiments) or 'all'}"[:200]
        run = client.create_run(exp_id, run_name=name, tags={
            ROLE_TAG: "report", "report.experiments": ",".join(experiments), "report.filter": filter_string[:5000],
            "report.group_by": ",".join(group_by), "mlflow.note.content": source})
        run_id = run.info.run_id
        client.log_param(run_id, "n_runs", len(records))
        client.log_param(run_id, "groups", ",".join(groups)[:6000])
        for row in fair:
            if row.get("lre") is not None:
                client.log_metric(run_id, metric_key(f"lre/{row['group']}"), float(row["lre"]))
        for row in t1:
            for b in benches:
                for kind in ("best", "last"):
                    if row.get(f"{b} {kind}") is not None:
                        client.log_metric(run_id, metric_key(f"{b}/{kind}/{row['group']}"), float(row[f"{b} {kind}"]))
        client.log_artifacts(run_id, str(out))
        client.set_terminated(run_id)
    return {"out": out, "n_runs": len(records), "groups": list(groups), "table1": t1, "fairness": fair,
            "by_length": by_len, "report_run_id": run_id}
