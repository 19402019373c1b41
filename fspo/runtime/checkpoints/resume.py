"""Resuming a run: which checkpoint a launch continues from, and which tracking run.

The MLflow run to continue is the one named in the checkpoint, else in ``<output_dir>/mlflow_run_id``. A
checkpoint of ANOTHER run folder continues in this folder's own MLflow run, tagged
``fspo.resumed_from.{checkpoint,run_id,step}``, and never writes into the run that made it. ``auto`` takes the
newest checkpoint that passes its checksum and reads, moving newer damaged ones to ``checkpoints/damaged/``;
when none passes the run stops and touches nothing (``resume=fresh`` starts over then). Nothing is deleted.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from omegaconf import DictConfig, OmegaConf

from fspo.runtime.checkpoints.files import RUN_ID_FILE, RUN_ID_KEY, checkpoint_dir, list_checkpoints, read_resume_meta
from fspo.runtime.checkpoints.integrity import CheckpointCorrupt, manifest_path, quarantine, verify
from fspo.runtime.launch.rank_zero import launch_rank

log = logging.getLogger(__name__)


@dataclass
class ResumePlan:
    """``ckpt_path`` for ``trainer.fit`` (None: fresh start), the RL ``step`` it holds, the MLflow ``run_id`` to
    continue (None: a new run); ``overrides``: this launch's allowed config changes (key -> "old -> new")."""

    ckpt_path: Optional[str] = None
    step: int = 0
    run_id: Optional[str] = None
    overrides: Dict[str, str] = field(default_factory=dict)
    origin: Dict[str, str] = field(default_factory=dict)  # another run's checkpoint: where it came from (MLflow tags)

    @property
    def resuming(self) -> bool:
        """True when continuing an earlier attempt (a checkpoint or an MLflow run exists)."""
        return self.ckpt_path is not None or self.run_id is not None


def check_checkpoint(path) -> None:
    """Raise unless ``path`` matches its checksum manifest and its resume metadata reads; one without
    manifest passes with a warning that its bytes were not verified."""
    manifest = verify(path)
    meta = read_resume_meta(path)
    if not manifest:
        man = manifest_path(path)
        others = [p.name for p in Path(path).parent.glob("step_*.ckpt" + man.suffix) if p != man]
        log.warning("checkpoint %s: its checksum manifest %s is MISSING (%s), so its bytes were NOT verified; "
                    "checked: it loads as a checkpoint with resume metadata (RL step %s). Loading it unverified -- "
                    "if you did not expect this, stop and use an earlier checkpoint (resume=<path>)", path, man.name,
                    f"deleted? {len(others)} other checkpoints here have theirs" if others
                    else "none of the checkpoints here has one: written before manifests existed, or all deleted",
                    meta.get("rl_step", "?"))


def scan_checkpoints(output_dir) -> Tuple[Optional[Path], List[Tuple[Path, str]]]:
    """(the newest usable checkpoint of ``output_dir`` or None, [(each damaged one newer than it, why)])."""
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


def _move_aside(bad: List[Tuple[Path, str]]) -> None:
    if launch_rank() != 0:  # the launching process moves; the other ranks reach the same verdict
        return
    for p, _ in bad:
        log.warning("moved damaged checkpoint %s to %s", p, quarantine(p))


def check_resume_target(cfg: DictConfig) -> None:
    """A dry run's ``resume=<path>`` must name a checkpoint that reads (one line if not)."""
    mode = OmegaConf.select(cfg, "resume", default=None)
    if mode is not None and str(mode) not in ("auto", "fresh"):
        _named_checkpoint(mode, "name a step_N.ckpt of the run, or use resume=auto with the run's folder")


def _named_checkpoint(mode, fix: str) -> Path:
    """``resume=<path>``: the checkpoint, which must exist and pass `check_checkpoint`; nothing is moved."""
    ckpt = Path(str(mode)).expanduser()
    if not ckpt.exists():
        raise FileNotFoundError(f"resume={mode}: no such checkpoint; {fix}")
    try:
        check_checkpoint(ckpt)
    except Exception as e:  # noqa: BLE001 - damaged or not a checkpoint: one line
        raise CheckpointCorrupt(f"resume={mode}: the checkpoint is damaged or unreadable ({type(e).__name__}: "
                                f"{str(e).splitlines()[0][:200]}); {fix}") from None
    return ckpt


def check_room(plan: "ResumePlan", output_dir) -> None:
    """Refuse a resume (one line) when ``<output_dir>/checkpoints`` has less room than its checkpoint's size."""
    import shutil

    if plan.ckpt_path is None:
        return
    ckpt = Path(plan.ckpt_path)
    need = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file()) if ckpt.is_dir() else ckpt.stat().st_size
    where = checkpoint_dir(output_dir) if checkpoint_dir(output_dir).is_dir() else Path(output_dir)
    free = shutil.disk_usage(where).free
    if free < need:
        raise ValueError(f"disk full: {where} has {free / 2**20:.0f} MiB free, and this run's next checkpoint "
                         f"needs about {need / 2**20:.0f} MiB (the size of {ckpt.name}): free space there, then run "
                         f"the same command again; nothing was changed")


def resolve_resume(cfg: DictConfig, output_dir) -> ResumePlan:
    """The `ResumePlan` for ``cfg.resume``: null starts fresh (an error over existing checkpoints), ``auto``
    continues from the newest usable checkpoint (an error when all are damaged), ``fresh`` starts over when all
    are damaged (an error when one is usable), a path continues from that checkpoint."""
    mode = OmegaConf.select(cfg, "resume", default=None)
    out = Path(output_dir)
    if checkpoint_dir(out).exists() and not checkpoint_dir(out).is_dir():
        raise ValueError(f"{checkpoint_dir(out)} is a file, but the run keeps its checkpoints in that folder: "
                              f"move or rename the file, or choose another output_dir")
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
        ckpt = _named_checkpoint(mode, f"use resume=auto to take the newest good one in {checkpoint_dir(out)}, "
                                       f"or name an earlier one")
    meta: Dict[str, Any] = read_resume_meta(ckpt) if ckpt is not None else {}
    own = id_file.read_text().strip() if id_file.is_file() else None
    origin: Dict[str, str] = {}
    if ckpt is not None and ckpt.resolve().parent not in (checkpoint_dir(out).resolve(),
                                                           (checkpoint_dir(out) / "damaged").resolve()):
        # another run's checkpoint: this folder's own MLflow run, tagged with where it came from
        run_id = own
        origin = {"fspo.resumed_from.checkpoint": str(ckpt.resolve()),
                  "fspo.resumed_from.step": str(meta.get("rl_step", 0)),
                  "fspo.resumed_from.run_id": str(meta.get(RUN_ID_KEY) or "unknown")}
    else:
        run_id = meta.get(RUN_ID_KEY) or own
    plan = ResumePlan(str(ckpt) if ckpt is not None else None, int(meta.get("rl_step", 0)), run_id or None,
                      origin=origin)
    log.info("resume=%s: %s", mode,
             f"continuing from {ckpt} (step {plan.step})" if ckpt else "no checkpoint, starting fresh")
    return plan
