"""Checking every setting of a composed config before anything runs: type, range, and the combinations
that cannot train.

Owns: `check_config(cfg)` and `ConfigError`. fspo/train.py calls it first, before any model loads, any
file is written or any MLflow run is opened. It raises `ConfigError` (a ValueError, so
experiments/run.py prints it as one line, exit code 2) for the first bad setting, with a message of
the form ``<key>=<value>: <what is wrong> (<what the key means>); <the fix>``, and returns the
warnings it logged (settings that run but are likely mistakes). A key absent from the config is not
checked (a config composed without it, e.g. one saved before the key existed).

The settings objects that are pure values (``ppo``, ``aggregator``, ``rollout.sampling``,
``val.sampling``, ``guard``: dataclasses, no I/O) are built here too, so their own checks (the batch
arithmetic of `fspo.update.microbatches.check_mini_batch` among them) also run before anything else.

Leaves out: checks that need files or the network — data files, model paths, the tracking store
(fspo/runtime/checks/store_check.py) — and the other components' argument checks, which run when they are built.
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from fspo.losses import AGG_MODES
from fspo.runtime.launch.precision import master_weight_problem
from fspo.runtime.launch.vllm_support import FIX as VLLM_FIX
from fspo.runtime.launch.vllm_support import installed_vllm_version, vllm_version_problem

log = logging.getLogger(__name__)

_ABSENT = object()
FLOAT32_MAX = 3.4028234663852886e38
LR_WARN = 1e-2  # above this AdamW fine-tuning of a pretrained LM almost always diverges
GROUP_ADVANTAGES = ("fspo.advantages.grpo", "fspo.advantages.rloo", "fspo.advantages.drgrpo")
SETTINGS_OBJECTS = ("ppo", "aggregator", "rollout.sampling", "val.sampling", "guard", "rollout_correction")  # pure values: built here


class ConfigError(ValueError):
    """A setting has the wrong type or range, or settings that cannot train together; the message names
    the key and the fix."""


@dataclass(frozen=True)
class Rule:
    """``key`` must be a ``kind`` ("int": a whole number, "number", "choice") within [lo, hi] (open
    ends when ``lo_open`` / ``hi_open``) or one of ``choices``; ``null`` only when ``nullable``.
    ``meaning`` says what the key is, ``example`` a valid value for the fix."""

    key: str
    kind: str
    lo: Optional[float] = None
    hi: Optional[float] = None
    lo_open: bool = False
    hi_open: bool = False
    choices: Tuple[Any, ...] = ()
    nullable: bool = False
    meaning: str = ""
    example: Any = None

    def requirement(self) -> str:
        if self.kind == "choice":
            return "one of " + ", ".join(str(c) for c in self.choices)
        what = "a whole number" if self.kind == "int" else "a number"
        lo = None if self.lo is None else f"{'>' if self.lo_open else '>='} {self.lo:g}"
        hi = None if self.hi is None else f"{'<' if self.hi_open else '<='} {self.hi:g}"
        if lo and hi:
            what += f" in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"
        elif lo or hi:
            what += f" {lo or hi}"
        return what + (" or null" if self.nullable else "")


def _int(key, lo=None, meaning="", example=None, nullable=False, hi=None) -> Rule:
    return Rule(key, "int", lo=lo, hi=hi, meaning=meaning, example=example, nullable=nullable)


def _pos(key, meaning="", example=None, nullable=False) -> Rule:
    return Rule(key, "number", lo=0, lo_open=True, meaning=meaning, example=example, nullable=nullable)


RULES: Tuple[Rule, ...] = (
    _int("steps", 1, "RL steps in the run", 60),
    _int("prompts_per_step", 1, "prompts per RL step", 16),
    _int("seed", None, "the run's random seed", 42),
    _int("cpu_threads", 1, "torch intra-op threads", 1, nullable=True),
    Rule("logger_fallback", "choice", choices=(None, "local"), meaning="what to do when the tracking "
         "server does not answer", example="local"),
    Rule("loss_agg_mode", "choice", choices=AGG_MODES, meaning="how token losses are aggregated",
         example="token-mean"),
    Rule("model.source", "choice", choices=("warmstart", "random", "pretrained"), meaning="where the "
         "policy comes from", example="pretrained"),
    _int("model.lora.rank", 0, "LoRA rank r; 0 turns LoRA off (full fine-tuning)", 8),
    _pos("model.lora.alpha", "LoRA scale numerator: the adapters add (alpha / r) B A", 16),
    _pos("model.lora.lr", "AdamW's learning rate for the LoRA adapters (null: ppo.lr)", 5e-4, nullable=True),
    Rule("model.lora.dropout", "number", lo=0, hi=1, hi_open=True, meaning="dropout on the LoRA adapters' input",
         example=0.0),
    Rule("model.dtype", "choice", choices=("float32", "bfloat16", "float16"), meaning="the policy's "
         "parameter dtype", example="float32"),
    # rollouts
    _int("rollout.sampling.n", 1, "completions per prompt, the group of the advantages", 8),
    _int("rollout.sampling.max_new_tokens", 1, "the longest response sampled", 128),
    _int("rollout.sampling.min_new_tokens", 0, "tokens before EOS is allowed", 0),
    _pos("rollout.sampling.temperature", "the training sampling temperature; training needs samples "
         "that differ and finite log-probs", 1.0),
    Rule("rollout.sampling.top_p", "number", lo=0, hi=1, lo_open=True, meaning="nucleus sampling mass",
         example=1.0),
    _int("rollout.sampling.top_k", None, "top-k filter (<= 0: off)", 0),
    _int("rollout.engine.batch_size", 1, "sequences the engine decodes at once", 256),
    # the update
    _int("ppo.mini_batch_size", 1, "one optimizer update's share of the step's batch", 32),
    Rule("ppo.mini_batch_unit", "choice", choices=("sequences", "prompts"), meaning="what "
         "ppo.mini_batch_size counts", example="sequences"),
    _int("ppo.epochs", 1, "passes over each step's batch", 1),
    _int("ppo.micro_batch_max_tokens", 1, "the token budget of one forward/backward", 8192),
    _int("ppo.lm_head_chunk_rows", 0, "positions per chunk of the chunked LM-head log-prob; 0: dense", 1024),
    Rule("ppo.pack_row_factor", "number", lo=1, meaning="packed row width relative to the longest "
         "sequence", example=2.0),
    _pos("ppo.lr", "AdamW's learning rate", 2e-5),
    _pos("ppo.max_grad_norm", "the gradient norm clipped to", 1.0),
    Rule("ppo.weight_decay", "number", lo=0, meaning="AdamW's weight decay", example=0.0),
    _int("ppo.warmup_steps", 0, "linear learning-rate warm-up in RL steps", 0),
    Rule("ppo.nonfinite", "choice", choices=("skip", "raise"), meaning="what a NaN/inf loss or gradient "
         "does", example="skip"),
    Rule("ppo.old_log_probs", "choice", choices=("engine", "recompute"), meaning="where old log-probs "
         "come from", example="recompute"),
    # validation and diagnostics
    _int("val.size", 0, "held-out prompts; 0 turns validation off", 256),
    _int("val.every_n_steps", 1, "RL steps between validations", 20),
    _int("val.batch_size", 1, "prompts per validation batch", 128),
    _int("val.sampling.n", 1, "validation samples per prompt (Avg@n)", 2),
    Rule("val.sampling.temperature", "number", lo=0, meaning="validation temperature (0: greedy)",
         example=0.6),
    Rule("val.sampling.top_p", "number", lo=0, hi=1, lo_open=True, meaning="validation nucleus mass",
         example=0.95),
    _int("data.max_prompt_len", 1, "the longest prompt in tokens", 64),
    Rule("dry_run", "choice", choices=(True, False), meaning="print the memory plan and exit", example="true"),
    _pos("memory_plan.device_gib", "GiB per rank the memory plan assumes instead of the device found", 80,
         nullable=True),
    _int("diagnostics.bin_width", 1, "clip-fraction length bin width in tokens", 16),
    Rule("diagnostics.lre_min_len", "number", lo=0, meaning="shortest length counted in the LRE",
         example=0),
    _int("diagnostics.reservoir_size", 1, "log-ratio samples kept for the Gaussianity checks", 4096),
    # console progress (fspo/tracking/progress.py)
    Rule("progress.mode", "choice", choices=("auto", "bar", "lines", "off"), meaning="the console progress: "
         "auto is a bar on a terminal, else log lines", example="lines"),
    _int("progress.every_n_steps", 1, "RL steps between progress lines", 5),
    # checkpoints
    _int("checkpoint.every_n_steps", 0, "RL steps between checkpoints (0: only the last)", 10),
    _int("checkpoint.keep_last", 1, "checkpoints kept", 2),
    # divergence guard (fspo/update/guard.py)
    Rule("guard.action", "choice", choices=("stop", "skip", "warn", "off"), meaning="what a breached "
         "divergence limit does", example="stop"),
    _pos("guard.max_grad_norm", "divergence limit on the gradient norm before clipping", 1e4, nullable=True),
    _pos("guard.max_loss", "divergence limit on the mini-batch's mean token loss", 1e3, nullable=True),
    _pos("guard.max_kl", "divergence limit on the mean KL(old || current) per token", 1.0, nullable=True),
    Rule("reward_guard.max_error_frac", "number", lo=0, hi=1, meaning="the fraction of a step's samples the reward "
         "may raise on before the run stops", example=0.0),
)


def _get(cfg: DictConfig, key: str) -> Any:
    """The resolved value at ``key`` (interpolations resolved, errors propagate), or `_ABSENT`."""
    return OmegaConf.select(cfg, key, default=_ABSENT, throw_on_missing=False)


def _fail(key: str, value: Any, problem: str, fix: str) -> ConfigError:
    shown = "null" if value is None else value
    return ConfigError(f"{key}={shown}: {problem}; {fix}")


def _check_rule(rule: Rule, value: Any) -> None:
    fix = f"set {rule.key}={rule.example}" if rule.example is not None else f"set {rule.key}"
    meaning = f" ({rule.meaning})" if rule.meaning else ""
    bad = _fail(rule.key, value, f"must be {rule.requirement()}{meaning}", fix)
    if value is None:
        if rule.nullable or (rule.kind == "choice" and None in rule.choices):
            return
        raise bad
    if rule.kind == "choice":
        if value not in rule.choices:
            raise bad
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad
    if rule.kind == "int" and not float(value).is_integer():
        raise bad
    v = float(value)
    if math.isnan(v) or (rule.kind == "int" and math.isinf(v)):
        raise bad
    if rule.lo is not None and (v < rule.lo or (rule.lo_open and v == rule.lo)):
        raise bad
    if rule.hi is not None and (v > rule.hi or (rule.hi_open and v == rule.hi)):
        raise bad


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask: a SLURM or cgroup limit counts)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _cross_checks(cfg: DictConfig, warnings: List[str]) -> None:
    """Settings that are each valid but cannot train together (errors) or probably should not (warnings)."""
    n = _get(cfg, "rollout.sampling.n")
    adv = str(_get(cfg, "advantage._target_"))
    if n == 1 and adv in GROUP_ADVANTAGES:
        raise _fail("rollout.sampling.n", n, f"with one completion per prompt every group-relative advantage "
                    f"({adv.rsplit('.', 1)[-1]}) is 0, so nothing learns", "set rollout.sampling.n >= 2")
    lo_new, hi_new = _get(cfg, "rollout.sampling.min_new_tokens"), _get(cfg, "rollout.sampling.max_new_tokens")
    if lo_new is not _ABSENT and hi_new is not _ABSENT and lo_new > hi_new:
        raise _fail("rollout.sampling.min_new_tokens", lo_new, f"is above rollout.sampling.max_new_tokens={hi_new}",
                    "lower it or raise rollout.sampling.max_new_tokens")
    threads, cores = _get(cfg, "cpu_threads"), usable_cores()
    if isinstance(threads, int) and not isinstance(threads, bool) and threads > cores:
        raise _fail("cpu_threads", threads, f"is above the {cores} cores this process may use (more torch threads "
                    f"than cores run many times slower; thousands hang)", f"set cpu_threads={cores} or less "
                    f"(1 is as fast for small models)")
    if _get(cfg, "model.dtype") == "float16" and str(_get(cfg, "trainer.accelerator")) == "cpu":
        raise _fail("model.dtype", "float16", "float16 training on the CPU (trainer.accelerator=cpu) is not "
                    "supported (no fp16 loss scaling there; CPU half kernels fail or crawl)",
                    "set model.dtype=float32 (or bfloat16) on CPU, or train on GPUs")
    reward = _get(cfg, "reward")
    for k, v in (reward.items() if isinstance(reward, DictConfig) else ()):  # a NaN reward weight trains on nothing
        if isinstance(v, float) and not math.isfinite(v):
            raise _fail(f"reward.{k}", v, "must be a finite number (a non-finite reward gives no learning signal)",
                        f"set reward.{k} to a finite number, e.g. reward.{k}=1.0")
    engine_target = str(_get(cfg, "rollout.engine._target_"))
    installed = installed_vllm_version() if engine_target.endswith("VLLMEngine") else None
    if installed is not None and vllm_version_problem(installed) is not None:  # not installed: the engine says so
        raise _fail("rollout.engine._target_", engine_target, vllm_version_problem(installed), VLLM_FIX)
    _lora_checks(cfg)
    if _get(cfg, "rollout.overlap.enable") is True:
        old, engine = _get(cfg, "ppo.old_log_probs"), str(_get(cfg, "rollout.engine._target_"))
        ds = _get(cfg, "rollout.dynamic_sampling.enable")
        for bad, problem, fix in (
                (old not in (_ABSENT, "engine"), f"ppo.old_log_probs={old} would take the ratio against the trainer's "
                 f"current weights, which did not sample the pipelined batch", "set ppo.old_log_probs=engine"),
                (not engine.endswith("HFEngine"), f"the engine process runs fspo.rollout.hf.HFEngine only, not {engine}",
                 "use rollout=hf"),
                (ds is True, "dynamic sampling draws extra prompts mid-step, which the pipeline cannot request ahead",
                 "set rollout.dynamic_sampling.enable=false"),
                (str(_get(cfg, "trainer.accelerator")) in ("gpu", "cuda"), "the pipelined engine process generates "
                 "with the HF engine on CPU, which a GPU trainer would wait for", "on GPUs use the colocated vLLM "
                 "engine (rollout=vllm rollout.overlap.enable=false), which time-shares each GPU through sleep/wake")):
            if bad:
                raise _fail("rollout.overlap.enable", True, problem, fix)
    budget, longest = _get(cfg, "ppo.micro_batch_max_tokens"), (_get(cfg, "data.max_prompt_len"), hi_new)
    if isinstance(budget, int) and all(isinstance(v, int) for v in longest) and budget < sum(longest):
        warnings.append(f"ppo.micro_batch_max_tokens={budget} is below the longest possible sequence (data.max_prompt_len"
                        f" + rollout.sampling.max_new_tokens = {sum(longest)}): a longer sequence runs as a micro-batch"
                        f" of its own, above the budget (same loss, more memory); set it >= {sum(longest)} to bound"
                        f" every micro-batch (docs/memory.md)")
    lr, betas = _get(cfg, "ppo.lr"), _get(cfg, "ppo.betas")
    if lr is not _ABSENT:
        beta1 = float(betas[0]) if betas not in (_ABSENT, None) and len(betas) else 0.9
        if lr / max(1.0 - beta1, 1e-12) >= FLOAT32_MAX:
            raise _fail("ppo.lr", lr, "AdamW's first step (lr / (1 - beta1)) overflows float32",
                        "use a learning rate below 1 (2e-5 for the tiny model, 1e-6 for Qwen3)")
        dtype = _get(cfg, "model.dtype")  # bf16 trainable weights at a fine-tuning lr learn nothing, silently
        lora = isinstance(_get(cfg, "model.lora.rank"), int) and _get(cfg, "model.lora.rank") > 0
        # with LoRA the trainable weights are the float32 adapters: a bf16 base is frozen, never stepped
        if dtype is not _ABSENT and (problem := master_weight_problem(str(dtype), float(lr), trainable=not lora)) is not None:
            raise ConfigError(problem)
        if lr > LR_WARN:
            warnings.append(f"ppo.lr={lr:g} is far above fine-tuning rates (1e-7..1e-4): expect divergence "
                            f"(the guard, guard.action, stops or skips diverging updates)")


def _lora_checks(cfg: DictConfig) -> None:
    """LoRA settings given while ``model.lora.rank`` is 0, and what LoRA cannot be combined with."""
    rank, targets = _get(cfg, "model.lora.rank"), _get(cfg, "model.lora.target_modules")
    if rank in (_ABSENT, None) or int(rank) == 0:
        if targets not in (_ABSENT, None):
            raise _fail("model.lora.rank", 0 if rank is _ABSENT else rank, f"model.lora.target_modules={list(targets)} "
                        "asks for LoRA adapters but rank 0 turns LoRA off", "set model.lora.rank=8 (or drop target_modules)")
        return
    if _get(cfg, "rollout.overlap.enable") is True:
        raise _fail("model.lora.rank", rank, "the pipelined engine process (rollout.overlap) shares plain model weights, "
                    "not LoRA adapters", "set rollout.overlap.enable=false with LoRA")
    if isinstance(targets, (list, tuple)) or (targets not in (_ABSENT, None) and OmegaConf.is_list(targets)):
        if len(targets) == 0:
            raise _fail("model.lora.target_modules", "[]", "no layer to adapt", "set it to null (every linear layer of "
                        "attention and MLP) or list some, e.g. [q_proj,v_proj]")
    elif targets not in (_ABSENT, None):
        raise _fail("model.lora.target_modules", targets, "must be a list of linear-layer names or null",
                    "write it as a list, e.g. model.lora.target_modules=[q_proj,v_proj]")


def _build_settings(cfg: DictConfig) -> None:
    """Build each of `SETTINGS_OBJECTS` present in ``cfg`` so that its own checks run; their ValueErrors
    (messages that name the key) become `ConfigError`."""
    for key in SETTINGS_OBJECTS:
        node = OmegaConf.select(cfg, key)
        if not isinstance(node, DictConfig) or "_target_" not in node:
            continue
        try:
            instantiate(node)
        except InstantiationException as e:
            if isinstance(e.__cause__, ValueError):
                raise ConfigError(str(e.__cause__)) from None
            raise
        except ValueError as e:
            raise ConfigError(str(e)) from None


def check_config(cfg: DictConfig) -> List[str]:
    """Raise `ConfigError` for the first bad setting of ``cfg`` (see the module docstring); return the
    warnings, each also logged."""
    for rule in RULES:
        value = _get(cfg, rule.key)
        if value is not _ABSENT:
            _check_rule(rule, value)
    warnings: List[str] = []
    _cross_checks(cfg, warnings)
    _build_settings(cfg)
    for w in warnings:
        log.warning("%s", w)
    return warnings
