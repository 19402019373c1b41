"""The config's value rules, checked once by `check_values`: before torch loads (run.py) and by `check_config`.

Owns: `Rule`, `RULES` (keys without a settings class: type, range, meaning, example), `ConfigError`,
`check_values` and the message form ``<key>=<value>: <what is wrong> (<what the key means>); <the fix>``.
Leaves out: the combinations of keys and the settings that need torch (config_check.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

from hydra.core.config_store import ConfigStore
from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf

from fspo.clipping.settings import settings_error

ABSENT = object()
FLOAT32_MAX = 3.4028234663852886e38
LR_WARN = 1e-2  # above this AdamW fine-tuning of a pretrained LM almost always diverges
GROUP_ADVANTAGES = ("fspo.advantages.grpo", "fspo.advantages.rloo", "fspo.advantages.drgrpo")
# fspo.losses.AGG_MODES, named here so that this table loads without torch (tests pin the two equal)
AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
# settings objects: key -> {_target_: the torch-free class `check_values` builds}; others: config_check.py
SAMPLING = {"fspo.rollout.base.SamplingConfig": "fspo.rollout.settings.SamplingConfig"}
SETTINGS_OBJECTS = {
    "rollout.sampling": SAMPLING,
    "val.sampling": SAMPLING,
    "ppo": {"fspo.update.settings.PPOConfig": "fspo.update.settings.PPOConfig"},  # after its mirrors
    "aggregator": {},
    "guard": {"fspo.update.guard.DivergenceGuard": "fspo.update.settings.GuardSettings"},
    "rollout_correction": {},
}


class ConfigError(ValueError):
    """A setting has the wrong type or range, or settings that cannot train together; the message names
    the key and the fix."""


@dataclass(frozen=True)
class Rule:
    """``key`` must be a ``kind`` ("int": a whole number, "number", "choice") within [lo, hi] (open
    ends when ``lo_open`` / ``hi_open``) or one of ``choices``; ``null`` only when ``nullable``.
    ``meaning`` says what the key is, ``example`` a valid value for the fix (None: the key's default)."""

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
    _int("steps", 1, "RL steps in the run"),
    _int("prompts_per_step", 1, "prompts per RL step"),
    _int("cpu_threads", 1, "torch intra-op threads", nullable=True),
    Rule("logger_fallback", "choice", choices=(None, "local"), meaning="what to do when the tracking "
         "server does not answer", example="local"),
    Rule("loss_agg_mode", "choice", choices=AGG_MODES, meaning="how token losses are aggregated"),
    Rule("model.source", "choice", choices=("warmstart", "random", "pretrained"), meaning="where the "
         "policy comes from", example="pretrained"),
    _int("model.lora.rank", 0, "LoRA rank r; 0 turns LoRA off (full fine-tuning)", 8),
    _pos("model.lora.alpha", "LoRA scale numerator: the adapters add (alpha / r) B A"),
    _pos("model.lora.lr", "AdamW's learning rate for the LoRA adapters (null: ppo.lr)", nullable=True),
    Rule("model.lora.dropout", "number", lo=0, hi=1, hi_open=True, meaning="dropout on the LoRA adapters' input"),
    Rule("model.dtype", "choice", choices=("float32", "bfloat16", "float16"), meaning="the policy's "
         "parameter dtype"),
    # rollouts
    _pos("rollout.sampling.temperature", "the training sampling temperature; training needs samples "
         "that differ and finite log-probs", 1.0),
    _int("rollout.engine.batch_size", 1, "sequences the engine decodes at once", 256),
    # validation and diagnostics
    _int("val.size", 0, "held-out prompts; 0 turns validation off"),
    _int("val.every_n_steps", 1, "RL steps between validations"),
    _int("val.batch_size", 1, "prompts per validation batch"),
    _int("val.sampling.n", 1, "validation samples per prompt (Avg@n)"),
    Rule("val.sampling.temperature", "number", lo=0, meaning="validation temperature (0: greedy)"),
    Rule("val.sampling.top_p", "number", lo=0, hi=1, lo_open=True, meaning="validation nucleus mass"),
    _int("data.max_prompt_len", 1, "the longest prompt in tokens", 64),
    # pipelined rollouts (fspo/rollout/pipeline.py): each step in flight holds a copy of the weights
    Rule("rollout.overlap.enable", "choice", choices=(True, False), meaning="pipelined rollouts in an engine "
         "process", example="false"),
    _int("rollout.overlap.staleness", 1, "steps of policy lag; each step in flight holds a copy of the policy's "
         "weights in shared memory", 1, hi=8),
    _int("rollout.overlap.engine_threads", 1, "torch threads of the engine process", 1),
    _pos("rollout.overlap.timeout_s", "the longest wait in seconds for one engine answer", 1800),
    Rule("dry_run", "choice", choices=(True, False), meaning="print the memory plan and exit", example="true"),
    _pos("memory_plan.device_gib", "GiB per rank the memory plan assumes instead of the device found", 80,
         nullable=True),
    _int("diagnostics.bin_width", 1, "clip-fraction length bin width in tokens", 16),
    Rule("diagnostics.lre_min_len", "number", lo=0, meaning="shortest length counted in the LRE",
         example=0),
    _int("diagnostics.reservoir_size", 1, "log-ratio samples kept for the Gaussianity checks"),
    Rule("diagnostics.law.records", "choice", choices=(True, False), meaning="record every measured sequence "
         "for run/law/*", example="true"),
    _int("diagnostics.law.per_octave", 1, "geometric length bins per doubling of L in run/law/*"),
    _int("diagnostics.law.min_count", 2, "sequences a length bin needs in run/law/*"),
    _int("diagnostics.law.n_boot", 0, "bootstrap draws of the std exponent's CI (0: none)"),
    _pos("diagnostics.law.random_direction", "relative size of the probe's random parameter direction", 1e-3,
         nullable=True),
    # console progress (fspo/tracking/progress.py)
    Rule("progress.mode", "choice", choices=("auto", "bar", "lines", "off"), meaning="the console progress: "
         "auto is a bar on a terminal, else log lines", example="lines"),
    _int("progress.every_n_steps", 1, "RL steps between progress lines"),
    # checkpoints
    _int("checkpoint.every_n_steps", 0, "RL steps between checkpoints (0: only the last)", 10),
    _int("checkpoint.keep_last", 1, "checkpoints kept", 2),
    Rule("reward_guard.max_error_frac", "number", lo=0, hi=1, meaning="the fraction of a step's samples the reward "
         "may raise on before the run stops"),
)


def get_setting(cfg: DictConfig, key: str) -> Any:
    """The resolved value at ``key`` (interpolations resolved, errors propagate), or `ABSENT`."""
    return OmegaConf.select(cfg, key, default=ABSENT, throw_on_missing=False)


def setting_error(key: str, value: Any, problem: str, fix: str) -> ConfigError:
    shown = "null" if value is None else f"{value:g}" if isinstance(value, float) else value  # typed: -1, not -1.0
    return ConfigError(f"{key}={shown}: {problem}; {fix}")


def check_values(cfg: DictConfig, then: Optional[Callable[[DictConfig], None]] = None) -> None:
    """`ConfigError` for the first bad value of ``cfg``: `RULES`, ``then(cfg)`` (check_config's combinations),
    the torch-free settings objects (ranges, cross-key rules) and the clip rule's settings."""
    for rule in RULES:
        value = get_setting(cfg, rule.key)
        if value is not ABSENT:
            check_rule(rule, value)
    if then is not None:
        then(cfg)
    for key, torch_free in SETTINGS_OBJECTS.items():
        node = OmegaConf.select(cfg, key)
        if isinstance(node, DictConfig) and str(node.get("_target_")) in torch_free:
            values = OmegaConf.to_container(node, resolve=True)
            try:
                get_class(torch_free[values.pop("_target_")])(**values)
            except ValueError as e:  # the messages name the key
                raise ConfigError(str(e)) from None
            except TypeError:  # a key the class does not take: the key check names the closest one
                pass
    clip = OmegaConf.select(cfg, "clip")
    if isinstance(clip, DictConfig) and (bad := settings_error(OmegaConf.to_container(clip, resolve=True))):
        raise ConfigError(bad)


def _default(key: str) -> Any:
    """``key``'s default in the stored root schema (`RunConfig`), or None."""
    stored = ConfigStore.instance().repo.get("run_schema.yaml")
    return None if stored is None else OmegaConf.select(stored.node, key, default=None, throw_on_missing=False)


def check_rule(rule: Rule, value: Any) -> None:
    example = rule.example if rule.example is not None else _default(rule.key)
    fix = f"set {rule.key}={example}" if example is not None else f"set {rule.key}"
    meaning = f" ({rule.meaning})" if rule.meaning else ""
    bad = setting_error(rule.key, value, f"must be {rule.requirement()}{meaning}", fix)
    if value is None:
        if rule.nullable or (rule.kind == "choice" and None in rule.choices):
            return
        raise bad
    if rule.kind == "choice":  # by type too: 1 == True in Python, yet enable=1 is no boolean
        if not any(isinstance(value, bool) == isinstance(c, bool) and value == c for c in rule.choices):
            raise bad
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad
    v = float(value)
    if not math.isfinite(v):  # nan and inf: no setting of this table means anything with them
        raise setting_error(rule.key, value, f"must be a finite number ({rule.requirement()}){meaning}", fix)
    if rule.kind == "int" and not v.is_integer():
        raise bad
    if rule.lo is not None and (v < rule.lo or (rule.lo_open and v == rule.lo)):
        raise bad
    if rule.hi is not None and (v > rule.hi or (rule.hi_open and v == rule.hi)):
        raise bad
