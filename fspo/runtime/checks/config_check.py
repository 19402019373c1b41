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
from typing import List

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from fspo.runtime.checks.config_rules import (
    ABSENT,
    FLOAT32_MAX,
    GROUP_ADVANTAGES,
    LR_WARN,
    SETTINGS_OBJECTS,
    ConfigError,
    check_values,
    get_setting,
    setting_error,
)
from fspo.runtime.launch.precision import master_weight_problem
from fspo.runtime.launch.vllm_support import FIX as VLLM_FIX
from fspo.runtime.launch.vllm_support import installed_vllm_version, vllm_version_problem

log = logging.getLogger(__name__)

def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask: a SLURM or cgroup limit counts)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _cross_checks(cfg: DictConfig, warnings: List[str]) -> None:
    """Settings that are each valid but cannot train together (errors) or probably should not (warnings)."""
    n = get_setting(cfg, "rollout.sampling.n")
    adv = str(get_setting(cfg, "advantage._target_"))
    if n == 1 and adv in GROUP_ADVANTAGES:
        raise setting_error("rollout.sampling.n", n, f"with one completion per prompt every group-relative advantage "
                    f"({adv.rsplit('.', 1)[-1]}) is 0, so nothing learns", "set rollout.sampling.n >= 2")
    hi_new = get_setting(cfg, "rollout.sampling.max_new_tokens")
    threads, cores = get_setting(cfg, "cpu_threads"), usable_cores()
    if isinstance(threads, int) and not isinstance(threads, bool) and threads > cores:
        raise setting_error("cpu_threads", threads, f"is above the {cores} cores this process may use (more torch "
                    f"threads than cores run many times slower; thousands hang)", f"set cpu_threads={cores} or less "
                    f"(1 is as fast for small models)")
    if get_setting(cfg, "model.dtype") == "float16" and str(get_setting(cfg, "trainer.accelerator")) == "cpu":
        raise setting_error("model.dtype", "float16", "float16 training on the CPU (trainer.accelerator=cpu) is not "
                    "supported (no fp16 loss scaling there; CPU half kernels fail or crawl)",
                    "set model.dtype=float32 (or bfloat16) on CPU, or train on GPUs")
    reward = get_setting(cfg, "reward")
    for k, v in (reward.items() if isinstance(reward, DictConfig) else ()):  # a NaN reward weight trains on nothing
        if isinstance(v, float) and not math.isfinite(v):
            raise setting_error(f"reward.{k}", v,
                        "must be a finite number (a non-finite reward gives no learning signal)",
                        f"set reward.{k} to a finite number, e.g. reward.{k}=1.0")
    engine_target = str(get_setting(cfg, "rollout.engine._target_"))
    installed = installed_vllm_version() if engine_target.endswith("VLLMEngine") else None
    if installed is not None and vllm_version_problem(installed) is not None:  # not installed: the engine says so
        raise setting_error("rollout.engine._target_", engine_target, vllm_version_problem(installed), VLLM_FIX)
    _lora_checks(cfg)
    if get_setting(cfg, "rollout.overlap.enable") is True:
        old, engine = get_setting(cfg, "ppo.old_log_probs"), str(get_setting(cfg, "rollout.engine._target_"))
        ds = get_setting(cfg, "rollout.dynamic_sampling.enable")
        for bad, problem, fix in (
                (old not in (ABSENT, "engine"), f"ppo.old_log_probs={old} would take the ratio against the trainer's "
                 f"current weights, which did not sample the pipelined batch", "set ppo.old_log_probs=engine"),
                (not engine.endswith("HFEngine"),
                 f"the engine process runs fspo.rollout.hf.HFEngine only, not {engine}",
                 "use rollout=hf"),
                (ds is True, "dynamic sampling draws extra prompts mid-step, which the pipeline cannot request ahead",
                 "set rollout.dynamic_sampling.enable=false"),
                (str(get_setting(cfg, "trainer.accelerator")) in ("gpu", "cuda"),
                 "the pipelined engine process generates with the HF engine on CPU, which a GPU trainer would wait for",
                 "on GPUs use the colocated vLLM "
                 "engine (rollout=vllm rollout.overlap.enable=false), which time-shares each GPU through "
                 "sleep/wake")):
            if bad:
                raise setting_error("rollout.overlap.enable", True, problem, fix)
    budget, longest = get_setting(cfg, "ppo.micro_batch_max_tokens"), (get_setting(cfg, "data.max_prompt_len"), hi_new)
    if isinstance(budget, int) and all(isinstance(v, int) for v in longest) and budget < sum(longest):
        warnings.append(f"ppo.micro_batch_max_tokens={budget} is below the longest possible sequence "
                        f"(data.max_prompt_len + rollout.sampling.max_new_tokens = {sum(longest)}): a longer sequence "
                        f"runs as a micro-batch"
                        f" of its own, above the budget (same loss, more memory); set it >= {sum(longest)} to bound"
                        f" every micro-batch (docs/memory.md)")
    lr, betas = get_setting(cfg, "ppo.lr"), get_setting(cfg, "ppo.betas")
    if lr is not ABSENT:
        beta1 = float(betas[0]) if betas not in (ABSENT, None) and len(betas) else 0.9
        if lr / max(1.0 - beta1, 1e-12) >= FLOAT32_MAX:
            raise setting_error("ppo.lr", lr, "AdamW's first step (lr / (1 - beta1)) overflows float32",
                        "use a learning rate below 1 (2e-5 for the tiny model, 1e-6 for Qwen3)")
        dtype = get_setting(cfg, "model.dtype")  # bf16 trainable weights at a fine-tuning lr learn nothing, silently
        lora = isinstance(get_setting(cfg, "model.lora.rank"), int) and get_setting(cfg, "model.lora.rank") > 0
        # with LoRA the trainable weights are the float32 adapters: a bf16 base is frozen, never stepped
        problem = None if dtype is ABSENT else master_weight_problem(str(dtype), float(lr), trainable=not lora)
        if problem is not None:
            raise ConfigError(problem)
        if lr > LR_WARN:
            warnings.append(f"ppo.lr={lr:g} is far above fine-tuning rates (1e-7..1e-4): expect divergence "
                            f"(the guard, guard.action, stops or skips diverging updates)")


def _lora_checks(cfg: DictConfig) -> None:
    """LoRA settings given while ``model.lora.rank`` is 0, and what LoRA cannot be combined with."""
    rank, targets = get_setting(cfg, "model.lora.rank"), get_setting(cfg, "model.lora.target_modules")
    if rank in (ABSENT, None) or int(rank) == 0:
        if targets not in (ABSENT, None):
            raise setting_error("model.lora.rank", 0 if rank is ABSENT else rank,
                        f"model.lora.target_modules={list(targets)} asks for LoRA adapters but rank 0 turns LoRA off",
                        "set model.lora.rank=8 (or drop target_modules)")
        return
    if get_setting(cfg, "rollout.overlap.enable") is True:
        raise setting_error("model.lora.rank", rank, "the pipelined engine process (rollout.overlap) shares plain "
                    "model "
                    "weights, not LoRA adapters", "set rollout.overlap.enable=false with LoRA")
    if isinstance(targets, (list, tuple)) or (targets not in (ABSENT, None) and OmegaConf.is_list(targets)):
        if len(targets) == 0:
            raise setting_error("model.lora.target_modules", "[]", "no layer to adapt",
                        "set it to null (every linear layer of attention and MLP) or list some, e.g. [q_proj,v_proj]")
    elif targets not in (ABSENT, None):
        raise setting_error("model.lora.target_modules", targets, "must be a list of linear-layer names or null",
                    "write it as a list, e.g. model.lora.target_modules=[q_proj,v_proj]")


def _build_settings(cfg: DictConfig) -> None:
    """Build the `SETTINGS_OBJECTS` that need torch, so that their checks run; a ValueError: `ConfigError`."""
    for key, torch_free in SETTINGS_OBJECTS.items():
        node = OmegaConf.select(cfg, key)
        if not isinstance(node, DictConfig) or "_target_" not in node or str(node._target_) in torch_free:
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
    warnings: List[str] = []
    check_values(cfg, then=lambda c: _cross_checks(c, warnings))
    _build_settings(cfg)
    for w in warnings:
        log.warning("%s", w)
    return warnings
