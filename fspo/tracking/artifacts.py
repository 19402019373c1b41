"""MLflow helpers for the training run: flattened params and end-of-run artifacts.

Owns: `flatten_params` (nested config -> ``a/b/c`` keys MLflow accepts, long values truncated)
and `log_final_artifacts` (run-level diagnostics as ``run/...`` metrics, their figures with the
clip rule's theory curve as PNG artifacts under ``plots/``, and the resolved config as
``config.yaml``). Leaves out: the per-step metrics (logged by the module through Lightning).
"""
from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any, Dict

import numpy as np
from omegaconf import OmegaConf

from fspo.diagnostics.metric_keys import display_key

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


def log_final_artifacts(logger, module, trainer, cfg) -> None:
    """Log run-level diagnostics, figures and the resolved config to the logger's MLflow run."""
    diag = module.run_diagnostics
    if diag is None or logger is None:
        return
    client, run_id = logger.experiment, logger.run_id
    metrics = diag.compute()
    step = int(module.rl_step)
    for k, v in metrics.items():
        client.log_metric(run_id, display_key(f"run/{k}"), float(v), step=step)  # one section, `run`
    sigma = metrics.get("logratio/sigma_hat", 0.0) or 0.0
    theory = None
    if sigma > 0:
        curve = module.clip.theory_clip_fraction
        if curve(np.array([1.0]), sigma) is not None:
            theory = {f"theory ({cfg.method}, sigma={sigma:.3g})": (lambda L: curve(np.asarray(L), sigma))}
    import matplotlib.pyplot as plt

    from fspo.tracking.run_figures import run_figures  # LRE and clip fractions by step, from the history

    for name, fig in {**diag.figures(theory=theory), **run_figures(client, run_id)}.items():
        client.log_figure(run_id, fig, f"plots/{name}.png")
        plt.close(fig)
    with tempfile.TemporaryDirectory() as tmp:
        p = Path(tmp) / "config.yaml"
        p.write_text(OmegaConf.to_yaml(cfg, resolve=True))
        client.log_artifact(run_id, str(p))
