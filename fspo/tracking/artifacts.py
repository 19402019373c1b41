"""What a training run logs besides its step metrics: flattened params and end-of-run artifacts.

At the end of a run every logger gets the run-level diagnostics as ``run/...`` metrics, their figures (with the
clip rule's theory curve) as ``plots/<name>.png``, the resolved ``config.yaml`` and a uniform sample of the
run's (L_i, S_i) as ``logratio_samples.csv``. With the MLflow server down the run metrics are buffered and the
files skipped for MLflow, in one warning line.
"""
from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any, Dict

import numpy as np
from omegaconf import OmegaConf

from fspo.diagnostics.law_summary import law_summary, law_table
from fspo.diagnostics.ledger import ledger_arrays, write_csv
from fspo.diagnostics.metric_keys import display_key
from fspo.tracking import sinks
from fspo.tracking.logger import as_list, mlflow_logger
from fspo.tracking.outage_buffer import TrackingServerDown

log = logging.getLogger(__name__)
MAX_PARAM_LEN = 6000  # MLflow's limit on a param value


def flatten_params(tree: Any, prefix: str = "") -> Dict[str, str]:
    """{"a/b": "value"} for every leaf of a nested dict/list (lists index as a/0, a/1)."""
    out: Dict[str, str] = {}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else None
    if items is None:
        return {prefix: str(tree)[:MAX_PARAM_LEN]}
    for k, v in items:
        key = f"{prefix}/{k}" if prefix else str(k)
        key = key.replace("_target_", "target")
        out.update(flatten_params(v, key))
    return out


def log_final_artifacts(loggers, module, trainer, cfg) -> None:
    """Log run-level diagnostics, figures and the resolved config to each of ``loggers`` (one or a list)."""
    diag, loggers = module.run_diagnostics, as_list(loggers)
    if diag is None or not loggers:
        return
    metrics = diag.compute()
    step = int(module.rl_step)
    ledger = getattr(module, "ledger", None)
    records = ledger.compute() if ledger is not None else None  # a collective, like diag.compute()
    metrics.update(_law_metrics(records, cfg))
    for lg in loggers:  # one section, `run`
        lg.log_metrics({display_key(f"run/{k}"): float(v) for k, v in metrics.items()}, step=step)
    sigma = metrics.get("logratio/sigma_hat", 0.0) or 0.0
    theory = None
    if sigma > 0:
        curve = module.clip.theory_clip_fraction
        if curve(np.array([1.0]), sigma) is not None:
            theory = {f"theory ({cfg.method}, sigma={sigma:.3g})": (lambda L: curve(np.asarray(L), sigma))}
    import matplotlib.pyplot as plt

    from fspo.tracking.run_figures import run_figures

    ml, down = mlflow_logger(loggers), []
    try:
        by_step = run_figures(ml.experiment, ml.run_id) if ml is not None and ml.run_id is not None else {}
    except TrackingServerDown:
        by_step = {}
        down.append("the by-step figures")
    for name, fig in {**diag.figures(theory=theory), **by_step}.items():
        for lg in loggers:
            _unless_down(down, f"plots/{name}.png", sinks.log_figure, lg, f"plots/{name}.png", fig, step)
        plt.close(fig)
    with tempfile.TemporaryDirectory() as tmp:
        p = Path(tmp) / "config.yaml"
        p.write_text(OmegaConf.to_yaml(cfg, resolve=True))
        files = [p]
        samples = logratio_samples(diag)
        if samples is not None:  # the (L, S) reservoir: the report's Figure 1 scatter
            files.append(Path(tmp) / SAMPLES_FILE)
            np.savetxt(files[-1], samples, delimiter=",", header="length,seq_log_ratio", comments="", fmt="%.9g")
        for lg in loggers:
            for f in files:
                _unless_down(down, f.name, sinks.log_file, lg, f, step)
    if records is not None and cfg.get("output_dir") and getattr(trainer, "is_global_zero", True):
        # the records behind run/law/*, in the output folder and the MLflow run
        p = write_csv(records, Path(cfg.output_dir) / "diagnostics" / "sequences.csv")
        if ml is not None and ml.run_id is not None:  # MLflow: artifact diagnostics/sequences.csv
            _unless_down(down, "diagnostics/sequences.csv", ml.experiment.log_artifact, ml.run_id, str(p),
                         "diagnostics")
    if down:  # one line; the same files are in the output folder's other loggers / run_config.yaml
        log.warning("MLflow server is down: not logged to the MLflow run: %s", ", ".join(down))
    for lg in loggers:
        sinks.finish(lg)


def _law_metrics(records, cfg) -> Dict[str, float]:
    """``law/*`` of the run's sequence records; {} without records."""
    if records is None:
        return {}
    law = OmegaConf.select(cfg, "diagnostics.law", default=None) or {}
    out = law_summary(ledger_arrays(records), per_octave=int(law.get("per_octave", 2)),
                      min_count=int(law.get("min_count", 50)), n_boot=int(law.get("n_boot", 200)),
                      seed=int(cfg.seed))
    if out:
        log.info("length law of this run (run/law/*):\n  %s", "\n  ".join(law_table(out)))
    return out


SAMPLES_FILE = "logratio_samples.csv"  # length,seq_log_ratio: a uniform sample of the run's (L_i, S_i)


def logratio_samples(diag) -> Any:
    """[n, 2] float array (L_i, S_i) of the run diagnostics' reservoir (a uniform sample), or None."""
    lr = getattr(diag, "log_ratio", None)
    if lr is None or getattr(lr, "reservoir_size", 0) == 0:
        return None
    n = min(int(lr.n_seen), int(lr.res_s.numel()))
    if n == 0:
        return None
    return np.stack([lr.res_len[:n].cpu().double().numpy(), lr.res_s[:n].cpu().numpy()], axis=1)


def _unless_down(down: list, what: str, fn, *args) -> None:
    """``fn(*args)``; an MLflow outage (`TrackingServerDown`) adds ``what`` to ``down`` instead."""
    try:
        fn(*args)
    except TrackingServerDown:
        down.append(what)
