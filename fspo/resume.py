"""Resuming a run and its MLflow logging: which checkpoint, which MLflow run, no duplicated steps.

Owns: `resolve_resume` (``resume``: null | auto | fresh | a checkpoint path -> `ResumePlan`), `build_logger`
(the configured logger after checking that the tracking server answers and that the store can be
written, fspo/store_check.py; continuing the plan's MLflow run; optional fallback to a local SQLite
store), `record_run_id`, `log_params_once`, `mark_preempted` and `TrackingURIUnreachable`. Leaves
out: writing checkpoints and signals (fspo/checkpointing.py).

Exactly-once metrics: a killed run may have logged steps after its last checkpoint; the resumed
run computes them again. On resume the logger skips every (metric, step) pair the MLflow run
already holds at or after the checkpoint's step (the first write wins, as with W&B's resume), so
each step keeps one value per metric; with deterministic training both writes are equal.
The run id lives in ``<output_dir>/mlflow_run_id`` (written at start) and in every checkpoint.

Damaged checkpoints (fspo/checkpoint_integrity.py): ``auto`` takes the newest checkpoint that passes
its checksum and reads; the damaged ones newer than it are moved to ``checkpoints/damaged/`` with a
warning. When none passes, the run stops with an error and touches nothing; ``resume=fresh`` is
the explicit way to start over from step 0 then (the damaged ones are moved aside, a new MLflow
run begins). Checkpoints are never deleted here.
"""
from __future__ import annotations

import logging
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple
from urllib.parse import urlparse

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from fspo.checkpoint_integrity import CheckpointCorrupt, quarantine, verify
from fspo.checkpointing import checkpoint_dir, list_checkpoints, read_resume_meta
from fspo.rank_zero import launch_rank
from fspo.store_check import NotAnMLflowServer, prepare_store

log = logging.getLogger(__name__)
RUN_ID_FILE = "mlflow_run_id"


class TrackingURIUnreachable(ValueError):
    """The MLflow tracking server did not answer at start-up (a bad ``logger.tracking_uri`` or a server down)."""


@dataclass
class ResumePlan:
    """``ckpt_path`` for ``trainer.fit`` (None: fresh start), the RL ``step`` it holds, and the MLflow
    ``run_id`` to continue (None: a new run). ``overrides``: the allowed config changes of this launch
    (key -> "old -> new", fspo/run_config.py), recorded as MLflow tags of the continued run."""

    ckpt_path: Optional[str] = None
    step: int = 0
    run_id: Optional[str] = None
    overrides: Dict[str, str] = field(default_factory=dict)

    @property
    def resuming(self) -> bool:
        """True when continuing an earlier attempt (a checkpoint or an MLflow run exists)."""
        return self.ckpt_path is not None or self.run_id is not None


def check_checkpoint(path) -> None:
    """Raise unless ``path`` matches its checksum manifest and its resume metadata reads; a checkpoint
    without manifest (an older version's) passes with a warning that it is unverified."""
    if not verify(path):
        log.warning("checkpoint %s has no checksum manifest (written by an older version): loading it unverified",
                    path)
    read_resume_meta(path)


def scan_checkpoints(output_dir) -> Tuple[Optional[Path], List[Tuple[Path, str]]]:
    """(the newest usable ``step_N.ckpt`` under ``<output_dir>/checkpoints`` or None, [(each damaged
    checkpoint newer than it, why)]), newest first. Nothing is moved or deleted."""
    bad: List[Tuple[Path, str]] = []
    for p in reversed(list_checkpoints(checkpoint_dir(output_dir))):
        try:
            check_checkpoint(p)
            return p, bad
        except Exception as e:  # noqa: BLE001 - a damaged checkpoint: fall back to the previous one
            if not p.exists():  # moved aside meanwhile (by rank 0 of this launch)
                continue
            msg = str(e).splitlines()[0][:200] if str(e) else ""
            why = msg if isinstance(e, CheckpointCorrupt) else f"unreadable, {type(e).__name__}: {msg}"
            log.warning("skipping damaged checkpoint %s (%s)", p, why)
            bad.append((p, why))
    return None, bad


def latest_complete_checkpoint(output_dir) -> Optional[Path]:
    """The newest usable ``step_N.ckpt`` under ``<output_dir>/checkpoints`` (damaged ones are skipped
    with a warning), or None."""
    return scan_checkpoints(output_dir)[0]


def _move_aside(bad: List[Tuple[Path, str]]) -> None:
    if launch_rank() != 0:  # the launching process moves; the other ranks reach the same verdict
        return
    for p, _ in bad:
        log.warning("moved damaged checkpoint %s to %s", p, quarantine(p))


def resolve_resume(cfg: DictConfig, output_dir) -> ResumePlan:
    """The `ResumePlan` for ``cfg.resume``: null starts fresh (an error if ``output_dir`` already holds
    checkpoints), ``auto`` continues from the newest usable checkpoint (fresh when there is none, in
    the same MLflow run if one was started; an error when all of them are damaged), ``fresh`` starts
    over from step 0 in a new MLflow run when all checkpoints are damaged (an error when one is usable),
    a path continues from that checkpoint (an error if it is damaged)."""
    mode = OmegaConf.select(cfg, "resume", default=None)
    out = Path(output_dir)
    id_file = out / RUN_ID_FILE
    if mode is None:
        found = list_checkpoints(checkpoint_dir(out))
        if found:
            raise ValueError(f"{checkpoint_dir(out)} already holds checkpoints of an earlier run ({found[-1].name}): "
                             f"pass resume=auto to continue it, or choose another output_dir")
        return ResumePlan()
    if str(mode) in ("auto", "fresh"):
        ckpt, bad = scan_checkpoints(out)
        if str(mode) == "fresh":
            if ckpt is not None:
                raise ValueError(f"resume=fresh: {ckpt} is a usable checkpoint of this run: resume=auto continues "
                                 f"it; to start over choose another output_dir")
            _move_aside(bad)
            old = id_file.read_text().strip() if id_file.is_file() else None
            log.warning("resume=fresh: starting over from step 0 in a new MLflow run%s",
                        f" (run {old} keeps what it logged)" if old else "")
            return ResumePlan()
        if ckpt is None and bad:
            raise CheckpointCorrupt(
                f"resume=auto: no checkpoint in {checkpoint_dir(out)} can be used ("
                + "; ".join(why if why.startswith(p.name) else f"{p.name}: {why}" for p, why in bad)
                + f"); nothing was changed. Pass resume=fresh to start this run over from step 0 (they are then moved "
                f"to {checkpoint_dir(out) / 'damaged'}, not deleted), or resume=<path> to try one of them")
        _move_aside(bad)
    else:
        ckpt = Path(str(mode)).expanduser()
        if not ckpt.exists():
            raise FileNotFoundError(f"resume={mode}: no such checkpoint; use resume=auto to pick the newest in "
                                    f"{checkpoint_dir(out)}")
        try:
            check_checkpoint(ckpt)
        except Exception as e:  # noqa: BLE001 - the named checkpoint is damaged: say so, move nothing
            raise CheckpointCorrupt(f"resume={mode}: the checkpoint is damaged ({type(e).__name__}: "
                                    f"{str(e).splitlines()[0][:200]}); use resume=auto to take the newest good one "
                                    f"in {checkpoint_dir(out)}, or name an earlier one") from None
    meta: Dict[str, Any] = read_resume_meta(ckpt) if ckpt is not None else {}
    run_id = meta.get("mlflow_run_id") or (id_file.read_text().strip() if id_file.is_file() else None)
    plan = ResumePlan(str(ckpt) if ckpt is not None else None, int(meta.get("rl_step", 0)), run_id or None)
    log.info("resume=%s: %s", mode, f"continuing from {ckpt} (step {plan.step})" if ckpt else "no checkpoint, starting fresh")
    return plan


def check_tracking_uri(uri: Optional[str], timeout_s: float = 5.0, attempts: int = 2) -> None:
    """Raise `TrackingURIUnreachable` unless an http(s) tracking server answers ``GET /health``
    (any HTTP status counts as an answer) within ``attempts`` tries of ``timeout_s``. Other URIs
    (sqlite, file, databricks) are not probed."""
    if not uri or urlparse(str(uri)).scheme not in ("http", "https"):
        return
    url, reason = str(uri).rstrip("/") + "/health", ""
    for i in range(attempts):
        try:
            urllib.request.urlopen(url, timeout=timeout_s).close()
            return
        except urllib.error.HTTPError:
            return
        except (urllib.error.URLError, OSError) as e:
            reason = str(getattr(e, "reason", e))
            if i + 1 < attempts:
                time.sleep(1.0)
    raise TrackingURIUnreachable(
        f"MLflow tracking server {uri} did not answer ({reason}): start it, fix logger.tracking_uri, or "
        f"set logger_fallback=local to log to a SQLite store in the output folder")


def _is_mlflow(lcfg) -> bool:
    return "MLFlowLogger" in str(lcfg.get("_target_", ""))


def build_logger(cfg: DictConfig, tags: Dict[str, str], output_dir, plan: ResumePlan):
    """Instantiate ``cfg.logger``; for MLflow: probe the tracking URI (fallback per ``logger_fallback``),
    continue ``plan.run_id`` (status back to RUNNING, already logged steps skipped). A new run is created
    lazily, at the first logging call, as before."""
    lcfg = cfg.logger
    if not _is_mlflow(lcfg):
        return instantiate(lcfg, tags=tags)
    kwargs: Dict[str, Any] = {}
    name = lcfg.get("experiment_name") if plan.run_id is None else None  # a continued run has its experiment
    try:
        check_tracking_uri(lcfg.get("tracking_uri"))
        prepare_store(lcfg.get("tracking_uri"), name, lcfg.get("artifact_location"))  # writable, fspo/store_check.py
    except (TrackingURIUnreachable, NotAnMLflowServer) as e:
        fallback = OmegaConf.select(cfg, "logger_fallback", default=None)
        if fallback != "local":
            raise
        out = Path(output_dir)
        local = f"sqlite:///{(out / 'mlflow.db').resolve()}"
        log.warning("%s -- logger_fallback=local: logging to %s instead", e, local)
        kwargs = {"tracking_uri": local, "artifact_location": str((out / "mlartifacts").resolve())}
        prepare_store(local, name, kwargs["artifact_location"])
    logger = instantiate(lcfg, tags=tags, run_id=plan.run_id, **kwargs)
    if plan.run_id is not None and _rank_zero():  # other ranks hold a dummy experiment
        try:
            client = logger.experiment  # get_run: fails for an unknown id
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"cannot continue MLflow run {plan.run_id} at {kwargs.get('tracking_uri', lcfg.get('tracking_uri'))} "
                             f"({type(e).__name__}: {str(e).splitlines()[0][:200]}): point logger.tracking_uri at "
                             f"the store the run was started in") from None
        client.update_run(plan.run_id, status="RUNNING")
        for key, change in plan.overrides.items():  # allowed config changes of this launch (params are immutable)
            client.set_tag(plan.run_id, f"fspo.resume.step_{plan.step}.{key}", change[:5000])
        _skip_logged(logger, plan.step)
    return logger


def record_run_id(logger, output_dir) -> None:
    """Write the MLflow run id to ``<output_dir>/mlflow_run_id`` (atomically; creates the run if needed)."""
    if not (_is_mlflow_logger(logger) and _rank_zero()):
        return
    out = Path(output_dir)
    tmp = out / (RUN_ID_FILE + ".tmp")
    tmp.write_text(str(logger.run_id) + "\n")
    tmp.replace(out / RUN_ID_FILE)


def _skip_logged(logger, from_step: int) -> None:
    """Make the logger's MLflow client drop (key, step) pairs the run already holds for steps >=
    ``from_step``: both paths metrics take (``log_batch`` from the logger, ``log_metric`` from
    fspo/mlflow_utils.py's run-level metrics)."""
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


def log_params_once(logger, params: Dict[str, str]) -> None:
    """Log ``params``; on a continued run only the keys it does not hold yet (MLflow params are
    immutable: a changed value, such as ``resume``, keeps its first value and is reported)."""
    if not (_is_mlflow_logger(logger) and _rank_zero()):
        logger.log_hyperparams(params)  # rank-zero-only itself
        return
    have = logger.experiment.get_run(logger.run_id).data.params
    new = {k: v for k, v in params.items() if k not in have}
    changed = sorted(k for k, v in params.items() if k in have and have[k] != str(v)[:250])
    if changed:
        log.warning("continued run keeps the first value of params %s", changed)
    if new:
        logger.log_hyperparams(new)


def _rank_zero() -> bool:
    from lightning.pytorch.utilities import rank_zero_only

    return getattr(rank_zero_only, "rank", 0) == 0


def _is_mlflow_logger(logger) -> bool:
    from lightning.pytorch.loggers import MLFlowLogger

    return isinstance(logger, MLFlowLogger)


def mark_preempted(logger, step: int) -> None:
    """After a signal stop: MLflow run status KILLED (Lightning marked it FAILED) and a tag with the step."""
    if not (_is_mlflow_logger(logger) and _rank_zero()):
        return
    try:
        logger.experiment.set_tag(logger.run_id, "fspo.stopped_at_step", str(step))
        logger.experiment.set_terminated(logger.run_id, status="KILLED")
    except Exception as e:  # noqa: BLE001 - never mask the stop itself
        log.warning("could not mark MLflow run %s as KILLED: %s", logger.run_id, e)
