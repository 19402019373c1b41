"""The console progress of a training run, in RL steps: a bar on a terminal, one log line every N steps elsewhere.

A line reads ``step 20/60 | 1.75 s/step | ETA 1:10 | reward 0.438 | val acc 0.607 | binding clip 0.070 | ...``
and waits for the validation that follows its step. s/step is the mean wall time per RL step since this fit
started (validations included); ETA = steps left x s/step. The short names are the MLflow Headline charts'.
"""
from __future__ import annotations

import logging
import math
import os
import sys
import time
from typing import Any, Dict, Mapping, Optional

from lightning.pytorch.callbacks import ProgressBar, TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm, convert_inf

log = logging.getLogger(__name__)

# metric key -> (short name, format); the order shown
FIELDS = (("reward/mean", "reward", "{:.3f}"), ("val/accuracy", "val acc", "{:.3f}"),
          ("clip/seq_frac", "binding clip", "{:.3f}"), ("fairness/lre", "LRE", "{:.3f}"),
          ("rollout/response_len_mean", "len", "{:.1f}"))
MODES = ("auto", "bar", "lines", "off")


def format_eta(seconds: float) -> str:
    """``M:SS`` under an hour, ``H:MM:SS`` from one hour; ``?`` when unknown."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


def short_metrics(metrics: Mapping[str, Any]) -> Dict[str, str]:
    """The FIELDS present in ``metrics`` (floats or 1-element tensors), short name -> formatted value."""
    return {name: fmt.format(float(metrics[key])) for key, name, fmt in FIELDS if key in metrics}


def progress_line(step: int, total: int, sec_per_step: Optional[float], metrics: Mapping[str, Any]) -> str:
    """One progress line; the ETA is ``(total - step) * sec_per_step``."""
    parts = [f"step {step}/{total}"]
    if sec_per_step is not None:
        parts += [f"{sec_per_step:.2f} s/step", f"ETA {format_eta((total - step) * sec_per_step)}"]
    parts += [f"{k} {v}" for k, v in short_metrics(metrics).items()]
    return " | ".join(parts)


def _latest(values: Dict[str, float], trainer) -> Dict[str, float]:
    """``values`` updated with the latest value of each FIELDS metric (Lightning's callback_metrics forget
    validation's when fit starts)."""
    for key, _, _ in FIELDS:
        v = trainer.callback_metrics.get(key)
        if v is not None and getattr(v, "numel", lambda: 1)() == 1:
            values[key] = float(v)
    return values


def _rl_step(trainer, pl_module) -> int:
    return int(getattr(pl_module, "rl_step", trainer.global_step))


class StepBar(TQDMProgressBar):
    """Lightning's tqdm bar counted in RL steps: ``RL step`` instead of ``Epoch 0/0``, s/step, no ``v_num``."""

    BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_inv_fmt}{postfix}]"

    def __init__(self, total: int) -> None:
        super().__init__(refresh_rate=1)
        self.total = int(total)
        self._latest: Dict[str, float] = {}

    def init_train_tqdm(self) -> Tqdm:
        return Tqdm(desc="RL step", position=2 * self.process_position, disable=self.is_disabled, leave=True,
                    dynamic_ncols=True, file=sys.stdout, smoothing=0, unit="step", bar_format=self.BAR_FORMAT)

    def on_train_epoch_start(self, trainer, *args: Any) -> None:  # Lightning's, without "Epoch 0"
        if self._leave:
            self.train_progress_bar = self.init_train_tqdm()
        self.train_progress_bar.reset(total=convert_inf(self.total_train_batches))
        self.train_progress_bar.initial = 0

    def init_validation_tqdm(self) -> Tqdm:  # no "Validation DataLoader 0" bar under ours: val acc is on it
        return Tqdm(disable=True)

    def init_sanity_tqdm(self) -> Tqdm:
        return Tqdm(disable=True)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        total = self.train_progress_bar.total
        if total is not None and batch_idx + 1 >= total:  # done: log lines after it start on their own line
            self.train_progress_bar.close()

    def on_validation_end(self, trainer, pl_module) -> None:
        _latest(self._latest, trainer)
        super().on_validation_end(trainer, pl_module)

    def get_metrics(self, trainer, pl_module) -> Dict[str, str]:
        return short_metrics(_latest(self._latest, trainer))


class StepLines(ProgressBar):
    """No tqdm: one log line (`progress_line`) every ``every_n_steps`` RL steps and at the last step."""

    def __init__(self, total: int, every_n_steps: int = 5) -> None:
        super().__init__()
        self.total, self.every_n_steps = int(total), int(every_n_steps)
        self._enabled = True
        self._latest: Dict[str, float] = {}
        self._t0: Optional[float] = None
        self._step0 = 0
        self._pending: Optional[tuple] = None  # (step, s/step) of a line not logged yet

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def on_train_start(self, trainer, pl_module) -> None:
        self._t0, self._step0 = time.perf_counter(), _rl_step(trainer, pl_module)

    def _flush(self, trainer) -> None:
        """Log the pending line with the latest metrics (a validation that followed its step included)."""
        if self._pending is not None:
            step, sec = self._pending
            self._pending = None
            log.info(progress_line(step, self.total, sec, _latest(self._latest, trainer)))

    def on_validation_end(self, trainer, pl_module) -> None:
        _latest(self._latest, trainer)
        self._flush(trainer)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._flush(trainer)  # no validation followed the previous step

    def on_train_end(self, trainer, pl_module) -> None:
        if not trainer.limit_val_batches:  # no held-out set: no validation will follow
            self._flush(trainer)

    def teardown(self, trainer, pl_module, stage) -> None:
        if stage != "fit":  # after the closing validation (fspo/train.py), or a stop: never lost
            self._flush(trainer)

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._flush(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = _rl_step(trainer, pl_module)
        _latest(self._latest, trainer)
        if not self._enabled or not (step % self.every_n_steps == 0 or step >= self.total):
            return
        done = step - self._step0
        sec = (time.perf_counter() - self._t0) / done if self._t0 is not None and done > 0 else None
        self._pending = (step, sec)  # logged once we know whether a validation follows


def _columns() -> int:
    try:
        return os.get_terminal_size(sys.stdout.fileno()).columns
    except (OSError, ValueError, AttributeError):
        return 0


def make_progress(mode: str, every_n_steps: int, total: int, is_tty: Optional[bool] = None,
                  columns: Optional[int] = None) -> Optional[ProgressBar]:
    """The progress callback for ``mode`` (``auto``: a bar on a terminal that reports a width, else lines)."""
    if mode not in MODES:
        raise ValueError(f"progress.mode={mode!r}: not one of {', '.join(MODES)}; set progress.mode=auto")
    if mode == "auto":
        tty = sys.stdout.isatty() if is_tty is None else is_tty
        mode = "bar" if tty and (_columns() if columns is None else columns) > 0 else "lines"
    if mode == "off":
        return None
    return StepBar(total) if mode == "bar" else StepLines(total, every_n_steps)
