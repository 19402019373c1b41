"""Resumable checkpoints: every N RL steps, on SIGTERM / SIGUSR1, written atomically, keep-last-k.

``checkpoints/step_000040.ckpt`` is the state after RL step 40 and its validation: what Lightning saves plus
``checkpoint["fspo_resume"]`` (every torchmetrics state, the RNG states, the MLflow run id, the run's config);
sampling seeds and mini-batch shuffles derive from ``rl_step``. Lightning writes ``step_N.ckpt.partial``, which
is fsynced and renamed after its SHA-256 manifest is written: a crash leaves only a ``.partial`` nothing reads.
A stop signal saves the last completed step at the next step boundary, then Lightning's ``SIGTERMException``
(exit 0) stops the run. Under SLURM `slurm_plugins` disables Lightning's requeue handler, which saves mid-step
inside the signal handler (Lightning-AI/pytorch-lightning#13773).
"""
from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Sequence

from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

from fspo.models.lora import adapter_state, is_lora
from fspo.runtime.checkpoints import stop_signal as stops
from fspo.runtime.checkpoints.files import META_KEY, RUN_ID_KEY, list_checkpoints
from fspo.runtime.checkpoints.integrity import (
    CheckpointCorrupt,
    atomic_commit,
    gathered_shard_digests,
    manifest_path,
    nonfinite_tensors,
    quarantine,
    write_manifest,
)
from fspo.runtime.checkpoints.resume_state import (
    extend_finished_run,
    load_metric_states,
    metric_states,
    rng_states,
    set_rng_states,
)
from fspo.runtime.launch.distributed import gather_objects, is_sharded

log = logging.getLogger(__name__)


def _remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)


def slurm_plugins() -> list:
    """``[SLURMEnvironment(auto_requeue=False)]`` when running under SLURM, else []."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    return [SLURMEnvironment(auto_requeue=False)] if SLURMEnvironment.detect() else []


def validation_follows(trainer) -> bool:
    """Whether Lightning validates right after the current training batch (its own rule)."""
    try:
        return bool(trainer.fit_loop.epoch_loop._should_check_val_fx(trainer.fit_loop._data_fetcher))
    except Exception:  # noqa: BLE001 - an internal that moved: checkpoint before validation instead
        return False


class StepCheckpoint(Checkpoint):
    """Saves ``step_N.ckpt`` every ``every_n_steps`` RL steps (0: never), after the last step (``save_last``)
    and at the first step boundary after a stop signal, then stops (exit 0); keeps the newest ``keep_last``.
    A resumed module whose parameters are not finite stops before the first step (`CheckpointCorrupt`)."""

    def __init__(self, dirpath, every_n_steps: int = 10, keep_last: int = 2, save_last: bool = True,
                 signals: Sequence[str] = ("SIGUSR1",), slurm_requeue: bool = False,
                 run_id_fn: Optional[Callable[[], Optional[str]]] = None, checksum: bool = True,
                 run_config: Optional[str] = None, continue_command: Optional[str] = None):
        bad = [s for s in signals if not hasattr(signal, str(s)) or str(s) in ("SIGKILL", "SIGSTOP")]
        if bad:
            raise ValueError(f"checkpoint.signals: {bad} are not catchable signal names (e.g. SIGUSR1, SIGUSR2)")
        self.dirpath, self.every_n_steps, self.keep_last = Path(dirpath), int(every_n_steps), int(keep_last)
        self.save_last, self.slurm_requeue, self.run_id_fn = bool(save_last), bool(slurm_requeue), run_id_fn
        self.checksum, self.run_config = bool(checksum), run_config
        self.continue_command = (continue_command
                                 or "python experiments/run.py output_dir=<the run's folder> resume=auto")
        self._started, self._was_outside = False, None  # on_train_start ran: a stop now has a step to save
        self.signals = [getattr(signal, str(s)) for s in signals]
        self._signal: Optional[str] = None
        self._pending: Optional[bool] = None  # a save deferred to the end of this step's validation (value: stop)
        self._in_val = False
        self._saved_step = -1
        self._requeued = False
        self._restore: Optional[Dict[str, Any]] = None
        self._old_handlers: Dict[int, Any] = {}
        self.last_path: Optional[Path] = None

    def _on_signal(self, signum, frame) -> None:
        self._signal = signal.Signals(signum).name
        stops.request_stop(self._signal)  # cuts a step's rollout short

    def on_train_start(self, trainer, pl_module) -> None:
        stops.reset()
        self._started, self._was_outside = True, stops.set_outside_fit(False)  # a stop now saves the last step first
        if threading.current_thread() is threading.main_thread():
            self._old_handlers = {s: signal.signal(s, self._on_signal) for s in self.signals}
            self._old_handlers.setdefault(signal.SIGTERM, stops.install_sigterm(trainer))  # no collective in a handler
        if self._restore is not None:  # after Lightning created the data iterators (they draw from the RNG)
            self._check_finite(trainer, pl_module)
            set_rng_states(self._restore["rng"])
            dm = trainer.datamodule
            pos = getattr(getattr(dm, "sampler", None), "position", None)
            if pos is not None and pos != int(pl_module.rl_step):
                raise RuntimeError(f"resumed checkpoint is inconsistent: prompt sampler at step {pos}, module at "
                                   f"rl_step {int(pl_module.rl_step)}")
            self._restore = None

    def _check_finite(self, trainer, pl_module) -> None:
        """Stop when the loaded parameters hold NaN/inf; this run's own checkpoint goes to ``damaged/``."""
        from fspo.runtime.launch.distributed import any_rank

        bad = nonfinite_tensors(pl_module.named_parameters())
        if not any_rank(bool(bad), pl_module.device):
            return
        path = Path(trainer.ckpt_path) if trainer.ckpt_path else None
        ours = path is not None and path.exists() and path.parent.resolve() == self.dirpath.resolve()
        moved = quarantine(path) if ours and trainer.is_global_zero else None
        trainer.strategy.barrier("fspo_checkpoint_nonfinite")
        names = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "") or "on another rank"
        fix = (f"moved it to {moved}; run again with resume=auto to continue from the newest good checkpoint"
               if ours else "resume from an earlier checkpoint (resume=<path>)")
        raise CheckpointCorrupt(f"checkpoint {path} loaded non-finite parameters ({names}): damaged without a "
                                f"checksum, or written after the run diverged; {fix}")

    def _restore_handlers(self) -> None:
        for s, h in self._old_handlers.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)
        self._old_handlers = {}

    def on_train_end(self, trainer, pl_module) -> None:
        if self._was_outside is not None:  # after the loop: a stop signal stops at once again
            stops.set_outside_fit(self._was_outside)
            self._was_outside = None

    def teardown(self, trainer, pl_module, stage) -> None:
        self._restore_handlers()
        self.on_train_end(trainer, pl_module)

    def _stop_requested(self, trainer) -> bool:
        local = self._signal is not None or bool(trainer.received_sigterm) or stops.stop_requested()
        return bool(trainer.strategy.reduce_boolean_decision(local, all=False))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step, stop = int(pl_module.rl_step), self._stop_requested(trainer)
        due = stop or (self.every_n_steps and step % self.every_n_steps == 0) or \
            (self.save_last and step >= trainer.num_training_batches)
        if not due:
            return
        if validation_follows(trainer):  # save after it: a checkpoint never precedes a step's validation
            self._pending = stop
            return
        self._save_and_maybe_stop(trainer, step, stop)

    def on_validation_start(self, trainer, pl_module) -> None:
        self._in_val = not trainer.sanity_checking and trainer.state.fn == "fit"

    def on_validation_end(self, trainer, pl_module) -> None:
        self._in_val = False
        if self._pending is not None and trainer.state.fn == "fit" and not trainer.sanity_checking:
            stop = self._pending or self._stop_requested(trainer)
            self._pending = None
            self._save_and_maybe_stop(trainer, int(pl_module.rl_step), stop)

    def on_exception(self, trainer, pl_module, exception) -> None:
        self._restore_handlers()
        step = int(pl_module.rl_step)
        if isinstance(exception, SIGTERMException):
            # Lightning stops on SIGTERM after a validation that our batch-end check did not see; a stop during
            # Lightning's setup (before on_train_start) has nothing new to save
            if trainer.state.fn == "fit" and self._started and not self._in_val and self._saved_step != step:
                self._save(trainer, step)  # also a step abandoned mid-rollout
            self._requeue(trainer)
            return
        if isinstance(exception, (CheckpointCorrupt, KeyboardInterrupt)):  # its message says what to do; a second
            return  # Ctrl-C: fspo/train.py's stop line
        last = self.last_path or (list_checkpoints(self.dirpath) or [None])[-1]
        log.error("training stopped at RL step %d by %s; the last complete checkpoint is %s; continue with: %s",
                  step, type(exception).__name__, last, self.continue_command)

    def _save_and_maybe_stop(self, trainer, step: int, stop: bool) -> None:
        self._save(trainer, step)
        if stop:
            self._requeue(trainer)
            log.info("stopping after RL step %d on %s", step, self._signal or stops.stop_signal_name())
            raise SIGTERMException()

    def _save(self, trainer, step: int) -> None:
        t0, final = time.perf_counter(), self.dirpath / f"step_{step:06d}.ckpt"
        tmp = final.with_name(final.name + ".partial")
        if trainer.is_global_zero:
            if self.dirpath.exists() and not self.dirpath.is_dir():
                raise ValueError(f"{self.dirpath} is a file, but the run keeps its checkpoints in that folder "
                                 f"(replaced while the run went on?): move the file away, then resume=auto")
            self.dirpath.mkdir(parents=True, exist_ok=True)
            for stale in self.dirpath.glob("*.partial"):
                _remove(stale)
        trainer.strategy.barrier("fspo_checkpoint_prepare")
        try:
            trainer.save_checkpoint(str(tmp), weights_only=False)  # collective; ends with a barrier
        except BaseException:  # a full disk: the partial file would keep it full; the last complete one stays
            if trainer.is_global_zero:
                _remove(tmp)
            raise
        known = gathered_shard_digests(trainer, tmp) if self.checksum else {}
        if trainer.is_global_zero:
            if self.checksum:  # committed before the checkpoint: a complete checkpoint has its manifest
                write_manifest(tmp, final, known)
            else:
                manifest_path(final).unlink(missing_ok=True)
            atomic_commit(tmp, final)
            for old in list_checkpoints(self.dirpath)[:-self.keep_last]:
                _remove(old)
                _remove(manifest_path(old))
            for man in self.dirpath.glob("step_*.ckpt.sha256"):  # a manifest whose checkpoint was never committed
                if not man.with_suffix("").exists():
                    _remove(man)
        trainer.strategy.barrier("fspo_checkpoint_commit")
        self._saved_step, self.last_path = step, final
        log.info("checkpoint %s written in %.2f s", final, time.perf_counter() - t0)

    def _requeue(self, trainer) -> None:
        job = os.environ.get("SLURM_JOB_ID")
        if not (self.slurm_requeue and job and trainer.is_global_zero) or self._requeued:
            return
        self._requeued = True
        if os.environ.get("SLURM_ARRAY_JOB_ID"):
            job = f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
        rc = subprocess.call(["scontrol", "requeue", job])
        log.warning("scontrol requeue %s -> exit code %d", job, rc)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: Dict[str, Any]) -> None:
        gathered = gather_objects(metric_states(pl_module))
        policy = getattr(pl_module, "policy", None)
        if policy is not None and is_lora(policy) and not is_sharded(policy):  # LoRA: the adapters, not the base,
            checkpoint["state_dict"] = adapter_state(checkpoint["state_dict"], policy)  # rebuilt from run_config
        checkpoint[META_KEY] = {"rl_step": int(pl_module.rl_step), "rng": rng_states(), "metrics": gathered,
                                RUN_ID_KEY: self.run_id_fn() if self.run_id_fn else None,
                                "world_size": trainer.world_size, "run_config": self.run_config}

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: Dict[str, Any]) -> None:
        meta = checkpoint.get(META_KEY)
        if meta is None:
            log.warning("checkpoint has no %r: metric states and RNG states are not restored", META_KEY)
            return
        extend_finished_run(trainer, checkpoint, int(meta["rl_step"]))
        per_rank, same = meta["metrics"], len(meta["metrics"]) == trainer.world_size
        if not same:
            log.warning("checkpoint written by %d ranks, resuming on %d: run-level diagnostics keep rank 0's "
                        "share only", len(per_rank), trainer.world_size)
        if same or trainer.is_global_zero:
            load_metric_states(pl_module, per_rank[trainer.global_rank if same else 0])
        self._restore = meta
        self._saved_step = int(meta["rl_step"])
