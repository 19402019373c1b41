"""Assemble and run one training job from a composed config, top to bottom: check every setting, plan memory
(``dry_run=true`` prints the plan and stops), hold ``output_dir``'s lock, settle what to resume (``resume=auto``:
the newest good checkpoint, its MLflow run and saved config), build policy, data, reward, clip rule, module,
rollout callback, loggers and Trainer, validate once, fit, and log the run-level diagnostics.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

import lightning as L
import torch
from hydra.utils import instantiate
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, OmegaConf

from fspo.data.datamodule import PromptDataModule
from fspo.diagnostics import FairnessMetrics, LengthBins
from fspo.diagnostics.ledger import SequenceLedger
from fspo.models.loading import enable_activation_checkpointing, load_policy
from fspo.models.lora import check_lora_targets, lora_update_settings, param_counts
from fspo.rollout.callback import RolloutCallback
from fspo.rollout.pipeline import build_pipeline
from fspo.runtime.checkpoints.checkpointing import StepCheckpoint, slurm_plugins
from fspo.runtime.checkpoints.continue_command import continue_command
from fspo.runtime.checkpoints.files import checkpoint_dir, list_checkpoints
from fspo.runtime.checkpoints.resume import ResumePlan, check_resume_target, check_room, resolve_resume
from fspo.runtime.checkpoints.stop_signal import honour_stop_signals, stop_signal_name
from fspo.runtime.checks.config_check import check_config
from fspo.runtime.checks.console import quiet_third_party
from fspo.runtime.checks.run_config import resume_config
from fspo.runtime.checks.run_lock import hold_output_dir
from fspo.runtime.checks.store_check import check_writable
from fspo.runtime.launch.auto_fit import auto_fit
from fspo.runtime.launch.memory_plan import check_memory_plan, dry_run
from fspo.runtime.launch.placement import place
from fspo.runtime.launch.rank_zero import RankZeroStub, launch_rank
from fspo.tracking.artifacts import flatten_params, log_final_artifacts
from fspo.tracking.logger import build_logger, log_params_once, mark_preempted, mlflow_logger, record_run_id
from fspo.tracking.outage_buffer import flush_or_report
from fspo.tracking.progress import make_progress
from fspo.update.direction_probe import RandomDirectionGate
from fspo.update.module import RLModule

log = logging.getLogger(__name__)


def build_fairness(cfg: DictConfig, seed: int) -> FairnessMetrics:
    d = cfg.diagnostics
    edges = d.get("bin_edges")  # explicit (e.g. geometric) edges win over bin_width / max_len
    bins = (LengthBins(edges=[int(e) for e in edges]) if edges
            else LengthBins(width=int(d.bin_width), max_len=int(d.max_len)))
    return FairnessMetrics(bins, lre_min_len=d.lre_min_len, reservoir_size=int(d.reservoir_size), seed=seed,
                           acceptance_on_policy=bool(d.get("acceptance_on_policy", False)),
                           figure_min_count=int(d.get("figure_min_count", 20)))


def train(cfg: DictConfig, overrides: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """Run the job described by ``cfg``; returns ``trainer.callback_metrics`` as floats. ``overrides``: this launch's
    command line (restored onto a continued run's saved config). A stop signal is honoured from the first line
    to the last: the run stops with one line naming the command that continues it."""
    quiet_third_party()  # each console line once, third-party noise filtered
    names = OmegaConf.select(cfg, "checkpoint.signals", default=None)  # StepCheckpoint checks them
    with honour_stop_signals([str(n) for n in names] if OmegaConf.is_list(names) else []):
        check_config(cfg)  # every setting, before anything is locked, loaded, written or opened
        if place(cfg, overrides):  # a GPU model on the GPUs found, or one line saying what it needs
            check_config(cfg)  # the placed settings together
        # a plan that does not fit: the settings that make it fit
        auto_fit(cfg, overrides, out=print if launch_rank() == 0 else log.info)
        if cfg.get("dry_run"):  # the per-rank memory plan, printed; nothing loaded or written
            check_resume_target(cfg)  # resume=<path> names a checkpoint that reads
            check_lora_targets(cfg.model)
            dry_run(cfg)
            return {}
        out_dir = Path(cfg.output_dir)
        seen: Dict[str, Any] = {}  # what _train built so far: the stop line's step, checkpoint and MLflow run
        with hold_output_dir(out_dir, owner=launch_rank() == 0):  # ranks other than 0 share rank 0's lock
            plan = resolve_resume(cfg, out_dir)  # the checkpoint and MLflow run to continue, if any
            try:
                run_cfg = resume_config(cfg, plan, out_dir, overrides)  # a continued run: its saved config
                return _train(run_cfg, plan, seen, recheck=run_cfg is not cfg)
            except (SIGTERMException, KeyboardInterrupt) as e:
                _report_stop(e, seen, plan, out_dir)
                raise


def _report_stop(exc: BaseException, seen: Dict[str, Any], plan: ResumePlan, out_dir: Path) -> None:
    """After a stop: the MLflow run KILLED at its step, buffered metrics sent, and one line with the step, the last
    checkpoint and the command that continues the run."""
    module, ckpt = seen.get("module"), seen.get("ckpt")
    step = int(module.rl_step) if module is not None else int(plan.step)
    loggers = seen.get("loggers") or []
    mark_preempted(loggers, step)
    flush_or_report(mlflow_logger(loggers))
    if launch_rank() != 0:
        return
    last = (getattr(ckpt, "last_path", None) or (list_checkpoints(checkpoint_dir(out_dir)) or [None])[-1])
    how = "a second Ctrl-C" if isinstance(exc, KeyboardInterrupt) else getattr(exc, "signal_name", None) or \
        stop_signal_name()
    where = "before the first training step" if step == 0 and last is None else f"at RL step {step}"
    log.warning("stopped on %s %s; %s; continue with: %s", how, where,
                f"last checkpoint {last}" if last is not None else "no checkpoint yet (the run starts over)",
                continue_command(out_dir))


def _train(cfg: DictConfig, plan: ResumePlan, seen: Dict[str, Any], recheck: bool = False) -> Dict[str, Any]:
    """The run itself, once `train` has settled its config and resume plan."""
    if recheck:  # the saved config with this launch's overrides, checked again as a whole
        check_config(cfg)
    L.seed_everything(int(cfg.seed), workers=True)
    if cfg.get("cpu_threads"):
        torch.set_num_threads(int(cfg.cpu_threads))
    ppo = instantiate(cfg.ppo)  # PPO and batch settings: a bad mini-batch fails here, before anything loads
    ppo = lora_update_settings(ppo, cfg.model)  # LoRA: model.lora.lr for the adapters
    check_lora_targets(cfg.model)  # LoRA targets the model does not have, a rank above a layer's side: one line
    check_memory_plan(cfg)  # logged; a layout that cannot fit is refused here too
    out_dir = Path(cfg.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    check_writable(out_dir, "output_dir")  # read-only or full: one line now, not at the first checkpoint
    check_room(plan, out_dir)  # a resume needs room for its next checkpoint
    # several ranks (trainer=fsdp): only rank 0 opens the MLflow store (the others would race on it)
    loggers = [RankZeroStub()] if launch_rank() != 0 else \
        build_logger(cfg, {"method": str(cfg.method), "model": str(cfg.model.name), "seed": str(cfg.seed),
                           **{str(k): str(v) for k, v in cfg.tags.items()}}, out_dir, plan)  # fails fast
    logger = mlflow_logger(loggers)  # the MLflow one, or None
    seen["loggers"] = loggers

    # policy and tokenizer; trainer=fsdp: parameters on the meta device, each rank reads its shard when sharded
    sharded = str(OmegaConf.select(cfg, "trainer.strategy._target_", default="") or "").endswith("FSDP2Strategy")
    policy, tokenizer = load_policy(**OmegaConf.to_container(cfg.model, resolve=True), seed=int(cfg.seed), meta=sharded)
    if cfg.model.get("activation_checkpointing"):  # one device too; trainer=fsdp also has its strategy's switch
        enable_activation_checkpointing(policy)
    policy.train()  # from_pretrained returns eval mode (a no-op here: no dropout; the engine switches to eval itself)

    # prompts
    train_source = instantiate(cfg.data.train)
    val_source = instantiate(cfg.data.val) if cfg.val.size and cfg.val.size > 0 else None
    data = PromptDataModule(train_source, val_source, prompts_per_step=int(cfg.prompts_per_step),
                            steps=int(cfg.steps), val_batch_size=int(cfg.val.batch_size), seed=int(cfg.seed))

    # the algorithm: clip rule, aggregation, PPO settings, diagnostics
    module = RLModule(policy=policy, clip=instantiate(cfg.clip), aggregator=instantiate(cfg.aggregator),
                      ppo=ppo, diagnostics=build_fairness(cfg, int(cfg.seed)),
                      run_diagnostics=build_fairness(cfg, int(cfg.seed)), seed=int(cfg.seed),
                      ledger=(SequenceLedger() if OmegaConf.select(cfg, "diagnostics.law.records", default=True)
                              else None),
                      guard=instantiate(cfg.guard) if OmegaConf.select(cfg, "guard") is not None else None,
                      correction=instantiate(rc) if (rc := OmegaConf.select(cfg, "rollout_correction")) is not None
                      else None,  # train-inference mismatch correction
                      probe_every=int(OmegaConf.select(cfg, "diagnostics.grad_probe_every", default=0) or 0))
    seen["module"] = module

    # rollouts
    sampling = instantiate(cfg.rollout.sampling)
    rollout = RolloutCallback(engine=instantiate(cfg.rollout.engine), tokenizer=tokenizer,
                              reward_fn=instantiate(cfg.reward), advantage_fn=instantiate(cfg.advantage),
                              sampling=sampling, val_sampling=instantiate(cfg.val.sampling),
                              max_prompt_len=int(cfg.data.max_prompt_len), seed=int(cfg.seed),
                              group_filter=instantiate(ds) if (ds := OmegaConf.select(cfg, "rollout.dynamic_sampling"))
                              is not None else None,  # DAPO dynamic sampling
                              pipeline=build_pipeline(cfg),  # rollout.overlap
                              max_reward_error_frac=float(OmegaConf.select(cfg, "reward_guard.max_error_frac",
                                                                           default=0.0) or 0.0),
                              advantage_mask=instantiate(am) if (am := cfg.get("advantage_mask")) else None)

    # logging and checkpoints
    log_params_once(loggers, flatten_params(OmegaConf.to_container(cfg, resolve=True)))
    for lg in loggers if plan.ckpt_path is None else ():  # every run, once (a resume logged them already)
        lg.log_metrics({k: float(v) for k, v in param_counts(policy).items()}, step=0)
    record_run_id(loggers, out_dir)
    ckpt = StepCheckpoint(checkpoint_dir(out_dir), **(OmegaConf.select(cfg, "checkpoint", default=None) or {}),
                          run_id_fn=lambda: getattr(logger, "run_id", None), run_config=OmegaConf.to_yaml(cfg),
                          continue_command=continue_command(out_dir))
    seen["ckpt"] = ckpt

    val_every = max(1, min(int(cfg.val.every_n_steps), int(cfg.steps)))  # fit validates every val_every steps
    progress = make_progress(str(OmegaConf.select(cfg, "progress.mode", default="auto")),
                             int(OmegaConf.select(cfg, "progress.every_n_steps", default=5)), int(cfg.steps)) \
        if OmegaConf.select(cfg, "trainer.enable_progress_bar", default=True) else None
    eps = OmegaConf.select(cfg, "diagnostics.law.random_direction", default=None)  # after the rollout callback
    probes = [RandomDirectionGate(float(eps), seed=int(cfg.seed))] if eps else []
    trainer = instantiate(cfg.trainer, default_root_dir=str(out_dir), logger=loggers,
                          callbacks=[rollout, ckpt] + ([progress] if progress is not None else []) + probes,
                          enable_progress_bar=progress is not None, plugins=slurm_plugins(),
                          val_check_interval=val_every if val_source is not None else None,
                          limit_val_batches=None if val_source is not None else 0)
    if val_source is not None and plan.ckpt_path is None:
        trainer.validate(module, datamodule=data, verbose=False)  # val/accuracy at step 0
        if getattr(logger, "run_id", None):  # rank 0: validate() marked the MLflow run finished
            logger.experiment.update_run(logger.run_id, status="RUNNING")
    trainer.fit(module, datamodule=data, ckpt_path=plan.ckpt_path)  # a stop signal: SIGTERMException (train())
    if val_source is not None and cfg.steps % val_every != 0:
        trainer.validate(module, datamodule=data, verbose=False)  # always end on a validation

    final = {k: float(v) for k, v in trainer.callback_metrics.items() if torch.is_tensor(v) and v.numel() == 1}
    log_final_artifacts(loggers, module, trainer, cfg)
    flush_or_report(logger)  # metrics buffered while the MLflow server was down: sent, or where they are
    log.info("run %s finished: %s", getattr(logger, "run_id", None),
             {k: round(v, 4) for k, v in final.items() if k.startswith("val/")})
    if launch_rank() == 0:  # where the results are: output dir, checkpoints, MLflow run
        print(_summary(logger, out_dir, final), flush=True)
    rollout.engine.shutdown()  # the last step (vLLM: frees its memory; it may tear down the process group)
    return final


def _summary(logger, out_dir: Path, final: Dict[str, float]) -> str:
    """The end-of-run block; MLflow lookups best-effort (a failing one leaves its fields out)."""
    from fspo.diagnostics.metric_keys import display_key
    from fspo.tracking.run_summary import training_summary

    run_id = getattr(logger, "run_id", None)
    uri, exp_name = getattr(logger, "_tracking_uri", None), getattr(logger, "_experiment_name", None)
    exp_id, run_name = getattr(logger, "_experiment_id", None), getattr(logger, "_run_name", None)
    start = steps = lre = None
    try:
        if run_id:
            client = logger.experiment
            run = client.get_run(run_id)
            exp_id, run_name = run.info.experiment_id, run.info.run_name
            lre = run.data.metrics.get(display_key("run/fairness/lre"))
            hist = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "val/accuracy"))
            if len(hist) >= 2:
                start, steps = hist[0][1], (hist[0][0], hist[-1][0])
    except Exception as e:  # noqa: BLE001 - the summary never fails a finished run
        log.debug("run summary: MLflow lookup failed: %s", e)
    return training_summary(out_dir, checkpoint_dir(out_dir), uri, exp_name, exp_id, run_name, run_id, final,
                            start_accuracy=start, steps=steps, run_lre=lre)
