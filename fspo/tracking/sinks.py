"""How an end-of-run artifact reaches each kind of experiment logger.

Owns: `log_figure(logger, name, fig, step)` and `log_file(logger, path, step)`, each dispatched on the
logger's class (MLflow: the run's artifacts; TensorBoard: ``add_figure`` / ``add_text``; W&B:
``wandb.Image`` / a run file under ``fspo/``; CSV and any other logger: a PNG / a copy of the file
under the logger's ``log_dir``; ranks other than 0: nothing), and `finish(logger)` (write out what a
file-based logger buffers). Leaves out: what is logged at the end of a run
(artifacts.py) and building the loggers (logger.py).

Dispatch is by class name along the logger's MRO, so neither wandb nor tensorboard is imported
unless such a logger is in use.
"""
from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, Optional

log = logging.getLogger(__name__)


def _kind(logger) -> str:
    names = {c.__name__ for c in type(logger).__mro__}
    for kind in ("RankZeroStub", "MLFlowLogger", "TensorBoardLogger", "WandbLogger"):
        if kind in names:
            return kind
    return "other"


def _log_dir(logger) -> Optional[Path]:
    d = getattr(logger, "log_dir", None) or getattr(logger, "save_dir", None)
    return Path(d) if d else None


# -- figures ----------------------------------------------------------------------------------
def _figure_mlflow(logger, name: str, fig, step: int) -> None:
    logger.experiment.log_figure(logger.run_id, fig, name)


def _figure_tensorboard(logger, name: str, fig, step: int) -> None:
    logger.experiment.add_figure(name.removesuffix(".png"), fig, global_step=step, close=False)


def _figure_wandb(logger, name: str, fig, step: int) -> None:
    import io

    from PIL import Image

    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    buf.seek(0)
    logger.log_image(key=name.removesuffix(".png"), images=[Image.open(buf)], step=step)


def _figure_file(logger, name: str, fig, step: int) -> None:
    d = _log_dir(logger)
    if d is None:
        log.warning("logger %s has no log_dir: figure %s not saved", type(logger).__name__, name)
        return
    p = d / name
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p)


def _nothing(*args) -> None:
    """Ranks other than 0 hold fspo/runtime/launch/rank_zero.py's `RankZeroStub`: nothing to write."""


_FIGURE: Dict[str, Callable] = {"RankZeroStub": _nothing, "MLFlowLogger": _figure_mlflow,
                                "TensorBoardLogger": _figure_tensorboard,
                                "WandbLogger": _figure_wandb, "other": _figure_file}


def log_figure(logger, name: str, fig, step: int) -> None:
    """Log matplotlib ``fig`` as ``name`` (a relative path ending in .png, e.g. ``plots/x.png``) at ``step``."""
    _FIGURE[_kind(logger)](logger, name, fig, step)


# -- files ------------------------------------------------------------------------------------
def _file_mlflow(logger, path: Path, step: int) -> None:
    logger.experiment.log_artifact(logger.run_id, str(path))


def _file_tensorboard(logger, path: Path, step: int) -> None:
    text = path.read_text()
    logger.experiment.add_text(path.name, "```\n" + text + "\n```", global_step=step)  # markdown: keep the layout


def _file_wandb(logger, path: Path, step: int) -> None:
    run_dir = Path(logger.experiment.dir)  # files written here are uploaded; W&B keeps its own config.yaml there
    dest = run_dir / "fspo" / path.name
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(path, dest)  # a copy: `save` only links the file, and ours is a temporary one
    logger.experiment.save(str(dest), base_path=str(run_dir), policy="now")


def _file_copy(logger, path: Path, step: int) -> None:
    d = _log_dir(logger)
    if d is None:
        log.warning("logger %s has no log_dir: %s not saved", type(logger).__name__, path.name)
        return
    d.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(path, d / path.name)


_FILE: Dict[str, Callable] = {"RankZeroStub": _nothing, "MLFlowLogger": _file_mlflow,
                              "TensorBoardLogger": _file_tensorboard,
                              "WandbLogger": _file_wandb, "other": _file_copy}


def log_file(logger, path, step: int) -> None:
    """Log the text file ``path`` (e.g. the resolved ``config.yaml``) under its own name."""
    _FILE[_kind(logger)](logger, Path(path), step)


def finish(logger: Any) -> None:
    """Write out what the logger buffers (after Lightning's own ``finalize`` at the end of fit, the end-of-run
    artifacts come later). MLflow writes each call at once; W&B finishes its run when the process exits."""
    if _kind(logger) in ("RankZeroStub", "MLFlowLogger", "WandbLogger"):
        return
    logger.finalize("success")
