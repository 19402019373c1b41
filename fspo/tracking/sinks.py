"""How an end-of-run artifact reaches each kind of experiment logger.

MLflow: the run's artifacts; TensorBoard: ``add_figure`` / ``add_text``; W&B: ``wandb.Image`` / a run file under
``fspo/``; CSV and any other logger: a PNG / a copy of the file under its ``log_dir``; ranks other than 0 (a
`RankZeroStub`): nothing. Dispatch is by class name along the logger's MRO, so neither wandb nor tensorboard is
imported unless such a logger is in use.
"""
from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any, Optional

log = logging.getLogger(__name__)


def _kind(logger) -> str:
    names = {c.__name__ for c in type(logger).__mro__}
    for kind in ("RankZeroStub", "MLFlowLogger", "TensorBoardLogger", "WandbLogger"):
        if kind in names:
            return kind
    return "other"


def _log_dir(logger, what: str) -> Optional[Path]:
    d = getattr(logger, "log_dir", None) or getattr(logger, "save_dir", None)
    if not d:
        log.warning("logger %s has no log_dir: %s not saved", type(logger).__name__, what)
    return Path(d) if d else None


def log_figure(logger, name: str, fig, step: int) -> None:
    """Log matplotlib ``fig`` as ``name`` (a relative path ending in .png, e.g. ``plots/x.png``) at ``step``."""
    kind = _kind(logger)
    if kind == "MLFlowLogger":
        logger.experiment.log_figure(logger.run_id, fig, name)
    elif kind == "TensorBoardLogger":
        logger.experiment.add_figure(name.removesuffix(".png"), fig, global_step=step, close=False)
    elif kind == "WandbLogger":
        import io

        from PIL import Image

        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        buf.seek(0)
        logger.log_image(key=name.removesuffix(".png"), images=[Image.open(buf)], step=step)
    elif kind == "other" and (d := _log_dir(logger, f"figure {name}")) is not None:
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(d / name)


def log_file(logger, path, step: int) -> None:
    """Log the text file ``path`` (e.g. the resolved ``config.yaml``) under its own name."""
    kind, path = _kind(logger), Path(path)
    if kind == "MLFlowLogger":
        logger.experiment.log_artifact(logger.run_id, str(path))
    elif kind == "TensorBoardLogger":  # markdown: keep the layout
        logger.experiment.add_text(path.name, "```\n" + path.read_text() + "\n```", global_step=step)
    elif kind == "WandbLogger":
        run_dir = Path(logger.experiment.dir)  # files written here are uploaded; W&B keeps its own config.yaml there
        dest = run_dir / "fspo" / path.name
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, dest)  # a copy: `save` only links the file, and ours is a temporary one
        logger.experiment.save(str(dest), base_path=str(run_dir), policy="now")
    elif kind == "other" and (d := _log_dir(logger, path.name)) is not None:
        d.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, d / path.name)


def finish(logger: Any) -> None:
    """Write out what a file-based logger buffers (the end-of-run artifacts come after Lightning's ``finalize``)."""
    if _kind(logger) not in ("RankZeroStub", "MLFlowLogger", "WandbLogger"):
        logger.finalize("success")
