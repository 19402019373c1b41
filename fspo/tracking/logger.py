"""The experiment loggers of a training run, built from ``logger:`` and ``extra_loggers:``; continuing a
resumed MLflow run.

Exactly-once metrics: a killed run may have logged steps after its last checkpoint, which the resumed run
computes again. On resume the logger skips every (metric, step) pair the MLflow run already holds at or after
the checkpoint's step (the first write wins, as with W&B's resume); with deterministic training both are equal.
"""
from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any, Dict, List, Optional
from urllib.parse import urlparse

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from fspo.runtime.checkpoints.files import RUN_ID_FILE
from fspo.runtime.checkpoints.resume import ResumePlan
from fspo.runtime.checks.store_check import NotAnMLflowServer, prepare_store
from fspo.runtime.launch.rank_zero import is_rank_zero
from fspo.tracking.naming import default_run_name, describe_experiment
from fspo.tracking.outage_buffer import health_error
from fspo.tracking.outage_buffer import install as install_buffer

log = logging.getLogger(__name__)


class TrackingURIUnreachable(ValueError):
    """The MLflow tracking server did not answer at start-up (a bad ``logger.tracking_uri`` or a server down)."""


def check_tracking_uri(uri: Optional[str], timeout_s: float = 5.0, attempts: int = 2,
                       key: str = "logger.tracking_uri", fallback: bool = True) -> None:
    """Raise `TrackingURIUnreachable` unless an http(s) ``uri`` answers ``GET /health`` (any HTTP status) within
    ``attempts`` tries; other URIs are not probed. ``fallback``: mention ``logger_fallback=local``."""
    if not uri or urlparse(str(uri)).scheme not in ("http", "https"):
        return
    for i in range(attempts):
        reason = health_error(uri, timeout_s)
        if reason is None:
            return
        if i + 1 < attempts:
            time.sleep(1.0)
    raise TrackingURIUnreachable(
        f"MLflow tracking server {uri} did not answer ({reason}): start it, fix {key}"
        + (", or set logger_fallback=local to log to a SQLite store in the output folder" if fallback else
           " (or MLFLOW_TRACKING_URI), or point it at a local store (sqlite:///mlflow.db)"))


def _is_mlflow(lcfg) -> bool:
    return "MLFlowLogger" in str(lcfg.get("_target_", ""))


def build_logger(cfg: DictConfig, tags: Dict[str, str], output_dir, plan: ResumePlan) -> List[Any]:
    """The run's loggers, ``cfg.logger`` then ``cfg.extra_loggers``, each given the arguments it accepts; at most
    one MLflow logger, which checks its store and continues ``plan.run_id``."""
    extra = OmegaConf.select(cfg, "extra_loggers", default=None)
    extra = OmegaConf.create({}) if extra is None else extra
    if not OmegaConf.is_dict(extra):
        raise ValueError(f"extra_loggers must name configs of conf/extra_loggers/ (got {extra!r}): select them "
                         f"as +extra_loggers=[csv,tensorboard]")
    lcfgs = [cfg.logger, *extra.values()]
    if sum(_is_mlflow(lc) for lc in lcfgs) > 1:
        raise ValueError("more than one MLflow logger (logger=mlflow and extra_loggers with mlflow): keep one, "
                         "e.g. drop mlflow from +extra_loggers")
    return [_build_mlflow(cfg, lc, tags, output_dir, plan) if _is_mlflow(lc) else _build_other(lc, tags, output_dir)
            for lc in lcfgs]


def check_wandb_login(offline: bool) -> None:
    """Raise ValueError when W&B runs online with neither ``WANDB_API_KEY`` nor a ~/.netrc entry for its host."""
    import netrc
    import os
    import urllib.parse

    if offline or os.environ.get("WANDB_MODE") in ("offline", "disabled", "dryrun") or os.environ.get("WANDB_API_KEY"):
        return
    host = urllib.parse.urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or ""
    with contextlib.suppress(OSError, netrc.NetrcParseError):
        if netrc.netrc().authenticators(host):
            return
    raise ValueError(f"the W&B logger has no API key (WANDB_API_KEY is unset and ~/.netrc has no `wandb login` entry "
                     f"for {host}): set WANDB_API_KEY or run `wandb login`, or log locally with offline=true on the "
                     f"W&B logger (logger.offline=true or extra_loggers.wandb.offline=true; WANDB_MODE=offline) and "
                     f"upload later with `wandb sync`")


def _build_other(lcfg, tags: Dict[str, str], output_dir) -> Any:
    """A non-MLflow logger: ``save_dir: null`` -> the run's output_dir; W&B gets the tags as ``key=value``."""
    kwargs: Dict[str, Any] = {}
    if "save_dir" in lcfg and lcfg.get("save_dir") is None:
        kwargs["save_dir"] = str(Path(output_dir))
    target = str(lcfg.get("_target_", ""))
    if target.endswith("WandbLogger"):
        check_wandb_login(bool(lcfg.get("offline", False)))  # now, not at the first metric mid-run
        kwargs["tags"] = [f"{k}={v}"[:64] for k, v in tags.items()]  # W&B: a list, 64 characters each
    try:
        return instantiate(lcfg, **kwargs)
    except (ImportError, ModuleNotFoundError) as e:
        raise ValueError(f"logger {target} cannot start: {str(e).splitlines()[0][:200]} (pip install tensorboard / "
                         f"wandb, or choose another logger)") from None


def _build_mlflow(cfg: DictConfig, lcfg, tags: Dict[str, str], output_dir, plan: ResumePlan):
    """The MLflow logger: store checks, optional local fallback, continuing ``plan.run_id``."""
    kwargs: Dict[str, Any] = {}
    name = lcfg.get("experiment_name") if plan.run_id is None else None  # a continued run has its experiment
    try:
        check_tracking_uri(lcfg.get("tracking_uri"))
        prepare_store(lcfg.get("tracking_uri"), name, lcfg.get("artifact_location"))  # refused unless writable
    except (TrackingURIUnreachable, NotAnMLflowServer) as e:
        fallback = OmegaConf.select(cfg, "logger_fallback", default=None)
        if fallback != "local":
            raise
        out = Path(output_dir)
        local = f"sqlite:///{(out / 'mlflow.db').resolve()}"
        log.warning("%s -- logger_fallback=local: logging to %s instead", e, local)
        kwargs = {"tracking_uri": local, "artifact_location": str((out / "mlartifacts").resolve())}
        prepare_store(local, name, kwargs["artifact_location"])
    if plan.run_id is None and not lcfg.get("run_name"):  # MLflow's random name repeats under a fixed seed
        kwargs["run_name"] = default_run_name(tags.get("method", "run"), tags.get("model", "model"),
                                              tags.get("seed", 0))
    if plan.run_id is None and plan.origin:  # another run's checkpoint: a new run that says where it came from
        tags = {**tags, **plan.origin}
    logger = instantiate(lcfg, tags=tags, run_id=plan.run_id, **kwargs)
    if is_rank_zero():  # an http server that dies mid-run: writes buffered, training goes on (outage_buffer.py)
        install_buffer(logger, output_dir)
    if plan.run_id is None and is_rank_zero():
        try:  # the experiment's description, once
            describe_experiment(logger._tracking_uri, logger._experiment_name)  # before the run exists
        except Exception as e:  # noqa: BLE001 - a description never fails a run
            log.warning("could not set the MLflow experiment description: %s", e)
    if plan.run_id is not None and is_rank_zero():  # other ranks hold a dummy experiment
        try:
            client = logger.experiment  # get_run: fails for an unknown id
        except Exception as e:  # noqa: BLE001
            uri = kwargs.get("tracking_uri", lcfg.get("tracking_uri"))
            raise ValueError(f"cannot continue MLflow run {plan.run_id} at {uri} "
                             f"({type(e).__name__}: {str(e).splitlines()[0][:200]}): point logger.tracking_uri at "
                             f"the store the run was started in") from None
        client.update_run(plan.run_id, status="RUNNING")
        for key, change in plan.overrides.items():  # allowed config changes of this launch (params are immutable)
            client.set_tag(plan.run_id, f"fspo.resume.step_{plan.step}.{key}", change[:5000])
        if not (OmegaConf.select(cfg, "rollout.overlap.enable", default=False)
                and drop_logged_steps(logger._tracking_uri, plan.run_id, plan.step)):
            _skip_logged(logger, plan.step)  # a synchronous resume re-logs identical values: keep the first
    return logger


def drop_logged_steps(uri: str, run_id: str, from_step: int) -> bool:
    """Delete run ``run_id``'s metric values at steps >= ``from_step`` from a SQLite store (rebuilding its latest
    values): pipelined rollouts re-run those steps with other values. False for other stores (MLflow has no
    API to delete metric values)."""
    import sqlite3

    from fspo.runtime.checks.store_check import _sqlite_path

    path = _sqlite_path(uri) if urlparse(str(uri)).scheme == "sqlite" else None
    if path is None:
        log.warning("resume: %s cannot delete metric values: steps >= %d keep the killed attempt's values", uri,
                    from_step)
        return False
    with sqlite3.connect(path, timeout=60) as con:
        n = con.execute("DELETE FROM metrics WHERE run_uuid = ? AND step >= ?", (run_id, int(from_step))).rowcount
        con.execute("DELETE FROM latest_metrics WHERE run_uuid = ?", (run_id,))
        con.execute("INSERT INTO latest_metrics (key, value, timestamp, step, is_nan, run_uuid) "
                    "SELECT key, value, timestamp, step, is_nan, run_uuid FROM (SELECT *, ROW_NUMBER() OVER "
                    "(PARTITION BY key ORDER BY step DESC, timestamp DESC, value DESC) AS rn FROM metrics "
                    "WHERE run_uuid = ?) WHERE rn = 1", (run_id,))
    if n:
        log.info("resume: dropped %d metric values of steps >= %d of run %s: the re-run steps log theirs", n,
                 from_step, run_id)
    return True


def as_list(loggers) -> List[Any]:
    """``loggers`` as a list (one logger, a list of them, or None)."""
    return [] if loggers is None else list(loggers) if isinstance(loggers, (list, tuple)) else [loggers]


def mlflow_logger(loggers) -> Optional[Any]:
    """The MLflow logger among ``loggers`` (a logger or a list), or None."""
    return next((lg for lg in as_list(loggers) if _is_mlflow_logger(lg)), None)


def record_run_id(loggers, output_dir) -> None:
    """Write the MLflow run id to ``<output_dir>/mlflow_run_id`` (atomically; creates the run if needed)."""
    logger = mlflow_logger(loggers)
    if logger is None or not is_rank_zero():
        return
    out = Path(output_dir)
    tmp = out / (RUN_ID_FILE + ".tmp")
    tmp.write_text(str(logger.run_id) + "\n")
    tmp.replace(out / RUN_ID_FILE)


def _skip_logged(logger, from_step: int) -> None:
    """Make the logger's MLflow client (``log_batch`` and ``log_metric``) drop (key, step) pairs the run already
    holds for steps >= ``from_step``."""
    client, run_id = logger.experiment, logger.run_id
    seen = {k: {m.step for m in client.get_metric_history(run_id, k) if m.step >= from_step}
            for k in client.get_run(run_id).data.metrics}
    seen = {k: v for k, v in seen.items() if v}
    if not seen:
        return
    log.info("MLflow run %s already holds steps %d..%d: those values are kept, not logged again", run_id,
             from_step, max(max(v) for v in seen.values()))
    log_batch, log_metric = client.log_batch, client.log_metric

    def fresh(rid, key, step) -> bool:
        return rid != run_id or int(step or 0) not in seen.get(key, ())

    def filtered_batch(run_id, metrics=(), params=(), tags=(), **kw):
        metrics = [m for m in metrics if fresh(run_id, m.key, m.step)]
        if metrics or params or tags:
            log_batch(run_id, metrics=metrics, params=params, tags=tags, **kw)

    def filtered_metric(run_id, key, value, timestamp=None, step=None, **kw):
        if fresh(run_id, key, step):
            log_metric(run_id, key, value, timestamp=timestamp, step=step, **kw)

    client.log_batch, client.log_metric = filtered_batch, filtered_metric


PER_LAUNCH = ("resume", "output_dir")  # differ between the launches of one run by design: never reported


def log_params_once(loggers, params: Dict[str, str]) -> None:
    """Log ``params`` to each logger; to MLflow on a continued run only the keys it does not hold yet (MLflow
    params are immutable: a changed value keeps its first value and is reported)."""
    for logger in as_list(loggers):
        if not (_is_mlflow_logger(logger) and is_rank_zero()):
            logger.log_hyperparams(params)  # rank-zero-only itself
            continue
        have = logger.experiment.get_run(logger.run_id).data.params
        new = {k: v for k, v in params.items() if k not in have}
        changed = sorted(k for k, v in params.items()
                         if k in have and have[k] != str(v)[:250] and k not in PER_LAUNCH)
        if changed:  # the changes a resume may make are recorded as fspo.resume.* tags
            log.info("continued run: MLflow params keep their first value (%s); this launch's values are in the "
                     "fspo.resume.* tags", ", ".join(changed))
        if new:
            logger.log_hyperparams(new)


def _is_mlflow_logger(logger) -> bool:
    from lightning.pytorch.loggers import MLFlowLogger

    return isinstance(logger, MLFlowLogger)


def mark_preempted(loggers, step: int) -> None:
    """After a signal stop: MLflow run status KILLED (Lightning marked it FAILED) and a tag with the step."""
    logger = mlflow_logger(loggers)
    if logger is None or not is_rank_zero():
        return
    try:
        logger.experiment.set_tag(logger.run_id, "fspo.stopped_at_step", str(step))
        logger.experiment.set_terminated(logger.run_id, status="KILLED")
    except Exception as e:  # noqa: BLE001 - never mask the stop itself
        log.warning("could not mark MLflow run %s as KILLED: %s", logger.run_id, e)
