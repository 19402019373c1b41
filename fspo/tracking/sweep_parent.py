"""Hydra callbacks for sweeps: one MLflow parent run per launch, the jobs nested under it.

`MLflowSweepParent` (``hydra.callbacks`` of ``sweeps/_base.yaml``) exports the parent's id as
``FSPO_MLFLOW_PARENT_RUN_ID``; the sweep configs' tag ``mlflow.parentRunId: ${oc.env:FSPO_MLFLOW_PARENT_RUN_ID}``
makes every job's run its child. At the end the parent is FINISHED, or FAILED if a job failed or the process
exited early.
"""
from __future__ import annotations

import atexit
import logging
import os
import time
from typing import Any, Optional

from hydra.core.utils import JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)
PARENT_ENV = "FSPO_MLFLOW_PARENT_RUN_ID"
ROLE_TAG = "fspo.role"  # "sweep_parent" on parents, "report" on report runs; jobs have none


def _select(cfg: DictConfig, key: str, default: Any = None) -> Any:
    """``OmegaConf.select`` that returns ``default`` for missing keys and failed interpolations (env not set yet)."""
    v = OmegaConf.select(cfg, key, default=default, throw_on_resolution_failure=False)
    return default if v is None else v


def effective_grid(params: Any, task_overrides: Any) -> dict:
    """The swept keys as the basic sweeper sees them: ``hydra.sweeper.params``, where a command-line
    override of the same key replaces the value, plus command-line sweeps (``k=a,b`` / ``range(...)``)."""
    grid = dict(OmegaConf.to_container(params)) if isinstance(params, DictConfig) else dict(params or {})
    for o in task_overrides or []:
        k, _, v = str(o).partition("=")
        if k in grid or "," in v or v.startswith(("range(", "choice(", "glob(")):
            grid[k] = v
    return grid


class MLflowSweepParent(Callback):
    """Create the MLflow parent run of a sweep (tags ``fspo.role=sweep_parent``, ``sweep``, ``model``,
    ``sweep.grid``, ``sweep.overrides``; at the end metrics ``sweep/jobs_ok``, ``sweep/jobs_failed``) and export
    its id to the jobs in ``env_var``."""

    def __init__(self, env_var: str = PARENT_ENV) -> None:
        self.env_var = env_var
        self.client = None
        self.run_id: Optional[str] = None
        self.ok = 0
        self.failed = 0
        self._closed = False
        self._where: dict = {}  # what the end-of-sweep block names

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._start(config, "hydra.sweep.dir")

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        # a sweep config run without -m (one job) still gets its parent run
        self._start(config, "hydra.run.dir")

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        if job_return is not None and job_return.status == JobStatus.FAILED:
            self.failed += 1
        else:
            self.ok += 1

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._finish()

    def on_run_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._finish()

    def _start(self, config: DictConfig, dir_key: str) -> None:
        from mlflow.tracking import MlflowClient

        from fspo.runtime.checks.console import quiet_mlflow
        from fspo.runtime.checks.store_check import ensure_experiment, prepare_store

        quiet_mlflow()  # no schema-creation lines when the parent run creates the store
        uri = _select(config, "logger.tracking_uri")
        exp_name = _select(config, "logger.experiment_name")
        if not uri or not exp_name:
            raise ValueError("MLflowSweepParent: the config needs logger.tracking_uri and logger.experiment_name "
                             "(sweeps/_base.yaml sets experiment_name = sweep.name)")
        sweep = str(_select(config, "sweep.name", exp_name))
        task = list(_select(config, "hydra.overrides.task", []) or [])
        params = effective_grid(_select(config, "hydra.sweeper.params", {}), task)
        grid = " ".join(f"{k}={v}" for k, v in params.items())
        overrides = " ".join(task)
        tags = {ROLE_TAG: "sweep_parent", "sweep": sweep, "model": str(_select(config, "model.name", "")),
                "sweep.grid": grid[:5000], "sweep.overrides": overrides[:5000],
                "mlflow.note.content": f"Parent run of sweep {sweep}; the jobs are its child runs.\n"
                                       f"grid: {grid}\noverrides: {overrides}"}
        art = _select(config, "logger.artifact_location")  # as the jobs' MLFlowLogger would create it
        art = None if art is None else str(art)
        prepare_store(str(uri), str(exp_name), art)  # under the store folder's lock, as a run's start
        self.client = MlflowClient(tracking_uri=str(uri))
        exp = ensure_experiment(str(uri), str(exp_name), art)  # None: deleted, left to MLflow's error
        exp_id = (exp or self.client.get_experiment_by_name(str(exp_name))).experiment_id
        run = self.client.create_run(exp_id, run_name=f"{sweep}-{time.strftime('%Y%m%d-%H%M%S')}", tags=tags)
        self.run_id = run.info.run_id
        self._where = {"sweep": sweep, "sweep_dir": _select(config, dir_key), "tracking_uri": str(uri),
                       "experiment_name": str(exp_name), "experiment_id": exp_id, "parent_name": run.info.run_name,
                       "group_by": str(_select(config, "sweep.group_by", "method") or "method")}
        os.environ[self.env_var] = self.run_id
        atexit.register(self._finish, "FAILED")  # an early exit leaves no RUNNING parent behind
        log.info("sweep %s: MLflow parent run %s in experiment %s (%s)", sweep, self.run_id, exp_name, uri)

    def _finish(self, status: Optional[str] = None) -> None:
        if self._closed or self.client is None or self.run_id is None:
            return
        self._closed = True
        status = status or ("FAILED" if self.failed else "FINISHED")
        try:
            self.client.log_metric(self.run_id, "sweep/jobs_ok", float(self.ok))
            self.client.log_metric(self.run_id, "sweep/jobs_failed", float(self.failed))
            self.client.set_terminated(self.run_id, status=status)
        except Exception as e:  # noqa: BLE001 - never mask the sweep's own outcome
            log.warning("sweep parent run %s: could not set status %s: %s", self.run_id, status, e)
        try:  # where the results are: experiment, parent run, jobs, how to open them
            from fspo.tracking.run_summary import sweep_summary

            print(sweep_summary(parent_id=self.run_id, jobs_ok=self.ok, jobs_failed=self.failed, status=status,
                                **self._where), flush=True)
        except Exception as e:  # noqa: BLE001
            log.warning("sweep summary: %s", e)
