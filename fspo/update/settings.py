"""The update's settings (``ppo:`` in conf/config.yaml): batch units, passes, optimizer, old log-probs.

Owns: `PPOConfig` and `GuardSettings` (``guard:``, the divergence guard's limits), pure values checked on
construction without torch (fspo/runtime/checks/config_keys.py and config_check.py build them before anything
loads), and the batch arithmetic `check_mini_batch` (``MINI_BATCH_UNITS``).
Leaves out: the update itself (fspo/update/module.py) and the mini-batch plans (fspo/update/microbatches.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

MINI_BATCH_UNITS = ("sequences", "prompts")
GUARD_ACTIONS = ("stop", "skip", "warn", "off")
# the numeric settings' ranges: field -> (lowest value, whether the lowest is excluded); nan and inf are refused
RANGES = {"mini_batch_size": (1, False), "epochs": (1, False), "micro_batch_max_tokens": (1, False),
          "pack_row_factor": (1, False), "max_grad_norm": (0, True), "lr": (0, True), "weight_decay": (0, False),
          "warmup_steps": (0, False), "lm_head_chunk_rows": (0, False)}


def check_mini_batch(prompts_per_step: int, n: int, mini_batch_size: int, unit: str = "sequences") -> int:
    """Optimizer updates per epoch of one step's batch; a ValueError naming the keys and the fix when
    ``ppo.mini_batch_size`` (counted in ``unit``) does not fit the step's batch of ``prompts_per_step``
    prompts x ``n`` samples. With ``unit="prompts"`` the batch must split into equal mini-batches of
    whole groups (verl: ``train_batch_size % ppo_mini_batch_size == 0``); with ``"sequences"`` the last
    mini-batch may be smaller (the behaviour before the unit existed)."""
    if unit not in MINI_BATCH_UNITS:
        raise ValueError(f"ppo.mini_batch_unit must be one of {', '.join(MINI_BATCH_UNITS)}, got {unit!r}")
    if mini_batch_size < 1:
        raise ValueError(f"ppo.mini_batch_size must be >= 1, got {mini_batch_size}")
    if prompts_per_step < 1 or n < 1:
        raise ValueError(f"prompts_per_step and rollout.sampling.n must be >= 1, got {prompts_per_step} and {n}")
    seqs = prompts_per_step * n
    step = prompts_per_step if unit == "prompts" else seqs
    batch = (f"the step's batch of prompts_per_step={prompts_per_step} prompts x rollout.sampling.n={n} "
             f"= {seqs} sequences")
    if mini_batch_size > step:
        hint = ""
        if unit == "prompts" and mini_batch_size <= seqs:
            hint = f"; if {mini_batch_size} counts sequences, set ppo.mini_batch_unit=sequences"
        raise ValueError(
            f"ppo.mini_batch_size={mini_batch_size} {unit} (ppo.mini_batch_unit={unit}) is larger than {batch}: "
            f"set ppo.mini_batch_size <= {step} or raise prompts_per_step{hint}")
    if unit == "prompts" and prompts_per_step % mini_batch_size:
        raise ValueError(
            f"prompts_per_step={prompts_per_step} does not split into whole mini-batches of "
            f"ppo.mini_batch_size={mini_batch_size} prompts (ppo.mini_batch_unit=prompts): make prompts_per_step "
            f"a multiple of ppo.mini_batch_size (every update then sees the same number of whole groups)")
    return -(-step // mini_batch_size)


@dataclass
class PPOConfig:
    """PPO-style update settings.

    ``mini_batch_size`` counts ``mini_batch_unit``: ``"prompts"`` (the default: whole groups of
    ``samples_per_prompt`` sequences, verl's ``ppo_mini_batch_size``) or ``"sequences"`` (rows shuffled singly:
    a group's siblings then land in later mini-batches, correlated with the update that moved the policy, a
    length-independent variance in S_L; docs/length_law.md). The paper
    (Table 2, run in verl) has 128 prompts x n 16 = 2,048 sequences per step and mini-batch 32
    prompts (512 sequences): 4 optimizer updates per step (conf/experiment/paper_*.yaml).
    ``prompts_per_step`` / ``samples_per_prompt`` mirror the root ``prompts_per_step`` and
    ``rollout.sampling.n`` (conf/config.yaml interpolates them): with both set the batch settings
    are checked on construction (`fspo.update.microbatches.check_mini_batch`), before any model loads.
    """

    mini_batch_size: int = 4  # one optimizer update's share of the step's batch, counted in mini_batch_unit
    mini_batch_unit: str = "prompts"  # prompts: whole groups of n | sequences: rows shuffled singly
    prompts_per_step: Optional[int] = None  # mirror of the root prompts_per_step (set that one)
    samples_per_prompt: Optional[int] = None  # mirror of rollout.sampling.n (set that one)
    epochs: int = 1  # passes over each step's batch
    micro_batch_max_tokens: int = 8192  # token budget of one forward/backward (real tokens of the packed row)
    packing: bool = True  # no padding: one row + per-sequence attention (sdpa), or rows; false: padded, sorted
    pack_row_factor: float = 2.0  # non-sdpa models' rows: widest = this x the longest sequence
    max_grad_norm: float = 1.0  # the gradient norm clipped to
    lr: float = 2e-5  # AdamW's learning rate (tiny model: 5e-5 was unstable; the Qwen3 presets: the paper's 1e-6)
    weight_decay: float = 0.0  # AdamW's weight decay
    betas: tuple = (0.9, 0.999)  # AdamW's betas
    warmup_steps: int = 0  # linear learning-rate warm-up in RL steps
    logprob_temperature: float = 1.0  # temperature of the trained log-probs (follows rollout.sampling.temperature)
    autocast: Optional[str] = None  # bf16: forward passes under torch.autocast(bfloat16), fp32 master weights
    lm_head_chunk_rows: int = 0  # > 0: the LM head's log-probs in chunks of this many positions (docs/memory.md)
    old_log_probs: str = "recompute"  # recompute: one more forward | engine: the rollout engine's log-probs
    log_entropy: bool = True  # log the policy's token entropy
    update_ratio: bool = True  # log train/update_ratio = ||theta_new - theta_old|| / ||theta_old|| every step
    nonfinite: str = "skip"  # what a NaN/inf loss or gradient does: skip (drop the update, counted) | raise

    def __post_init__(self):
        for name, (lo, strict) in RANGES.items():
            value = getattr(self, name)
            if not math.isfinite(value) or value < lo or (strict and value == lo):
                raise ValueError(f"ppo.{name}={value:g}: must be a number {'>' if strict else '>='} {lo}; "
                                 f"set ppo.{name}={getattr(PPOConfig, name):g}")
        if self.mini_batch_unit not in MINI_BATCH_UNITS:
            raise ValueError(f"ppo.mini_batch_unit must be one of {', '.join(MINI_BATCH_UNITS)}, "
                             f"got {self.mini_batch_unit!r}")
        if self.prompts_per_step is not None and self.samples_per_prompt is not None:
            check_mini_batch(int(self.prompts_per_step), int(self.samples_per_prompt), self.mini_batch_size,
                             self.mini_batch_unit)
        if self.autocast not in (None, "bf16"):
            raise ValueError(f"ppo.autocast must be null or 'bf16', got {self.autocast!r}")
        if self.autocast == "bf16" and self.old_log_probs == "engine":
            raise ValueError("ppo.autocast=bf16 with ppo.old_log_probs=engine: the engine's float32 log-probs would "
                             "differ from the trainer's bf16 ones by rounding, not by the policy: set "
                             "ppo.old_log_probs=recompute")
        if self.nonfinite not in ("skip", "raise"):
            raise ValueError(f"ppo.nonfinite must be 'skip' or 'raise', got {self.nonfinite!r}")
        if self.old_log_probs not in ("recompute", "engine"):
            raise ValueError(f"ppo.old_log_probs must be 'recompute' or 'engine', got {self.old_log_probs!r}")
        if self.old_log_probs == "engine" and float(self.logprob_temperature) != 1.0:
            raise ValueError(
                f"ppo.old_log_probs=engine takes the engine's log-probs, which are at temperature 1 (raw logits), "
                f"but ppo.logprob_temperature is {self.logprob_temperature} (it follows rollout.sampling.temperature): "
                f"set ppo.old_log_probs=recompute")

    @property
    def updates_per_step(self) -> Optional[int]:
        """Optimizer updates per RL step (``epochs`` x mini-batches), None without the batch mirrors."""
        if self.prompts_per_step is None or self.samples_per_prompt is None:
            return None
        return self.epochs * check_mini_batch(int(self.prompts_per_step), int(self.samples_per_prompt),
                                              self.mini_batch_size, self.mini_batch_unit)

    def minibatch_plan(self, batch_size: int, generator: "torch.Generator", group_ids=None) -> list:  # noqa: F821
        """The step's mini-batches (row indices of the global batch of ``batch_size`` rows, group ids
        ``group_ids`` [B]) in training order: `fspo.update.microbatches.minibatch_plan`."""
        from fspo.update.microbatches import minibatch_plan

        return minibatch_plan(batch_size, self.mini_batch_size, self.epochs, generator, self.mini_batch_unit,
                              group_ids)


@dataclass
class GuardSettings:
    """The divergence guard's limits (guard.py `DivergenceGuard`), checked before each optimizer step; null: off."""

    action: str = "stop"  # stop: end the run (one line) | skip: drop that update | warn: log and step | off
    max_grad_norm: Optional[float] = 1.0e4  # global gradient norm before clipping (healthy runs: < 10)
    max_loss: Optional[float] = 1.0e3  # |mean per-token surrogate loss| of the mini-batch (healthy: < 5)
    max_kl: Optional[float] = 1.0  # mean per-token KL(old || current), k3, of the mini-batch (healthy: < 0.05)

    def __post_init__(self):
        if self.action not in GUARD_ACTIONS:
            raise ValueError(f"guard.action={self.action}: must be one of {', '.join(GUARD_ACTIONS)} (what a breached "
                             f"divergence limit does); set guard.action=stop")
        for k in ("max_grad_norm", "max_loss", "max_kl"):
            v = getattr(self, k)
            if v is not None and not (math.isfinite(v) and v > 0):
                raise ValueError(f"guard.{k}={v:g}: must be a number > 0 or null (a divergence limit); "
                                 f"set guard.{k}={getattr(GuardSettings, k):g}")
