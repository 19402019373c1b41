"""The run's config as typed schemas: keys, types, defaults and one-line docs, stated once.

Owns: `RunConfig` (the root) and its plain nodes; `schema` makes one of a settings class (PPOConfig, ...).
The root and ``model`` also take keys they do not list (a sweep's ``sweep:``, ``extra_loggers``, a model's
``arch:``). Leaves out: the value ranges (config_rules.py, the settings classes) and the code that reads them.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field, fields, make_dataclass
from typing import Any, Dict, Optional, Sequence, get_type_hints

from omegaconf import MISSING

from fspo.rollout.settings import CorrectionSettings, SamplingConfig
from fspo.update.settings import GuardSettings, PPOConfig

PPO_TARGET = "fspo.update.settings.PPOConfig"
SAMPLING_TARGET = "fspo.rollout.base.SamplingConfig"  # (the name stored configs use)
# a dataclass subclassing Dict takes keys it does not list (a form OmegaConf calls deprecated)
warnings.filterwarnings("ignore", message="Class `(RunConfig|ModelConfig|EvalModelConfig)` subclasses `Dict`")


def schema(cls: type, target: str, drop: Sequence[str] = ("owner",), **defaults: Any) -> type:
    """``cls``'s fields but ``drop`` (``defaults`` replace some) after ``_target_: str = target``;
    ``__settings__`` is ``cls`` (the docs)."""
    hints = get_type_hints(cls)
    specs = [("_target_", str, field(default=target))]
    for f in fields(cls):
        if f.name not in drop:
            default = defaults.get(f.name, f.default)
            specs.append((f.name, hints[f.name], field(default=default, default_factory=f.default_factory)))
    node = make_dataclass(cls.__name__, specs)
    node.__settings__ = cls
    return node


PPO = schema(PPOConfig, PPO_TARGET, drop=("betas",))
GUARD = schema(GuardSettings, "fspo.update.guard.DivergenceGuard")
CORRECTION = schema(CorrectionSettings, "fspo.rollout.correction.RolloutCorrection")
SAMPLING = schema(SamplingConfig, SAMPLING_TARGET, drop=("seed",))
VAL_SAMPLING = schema(SamplingConfig, SAMPLING_TARGET, drop=("seed", "min_new_tokens"), n=2, temperature=0.6,
                      top_p=0.95, top_k=200, max_new_tokens=MISSING)


@dataclass
class LawConfig:
    """The run's length law (fspo/diagnostics/law_summary.py): run/law/* at the end."""

    records: bool = True  # one record per measured sequence -> <output_dir>/diagnostics/sequences.csv
    per_octave: int = 2  # geometric length bins for run/law/* (2 per doubling of L)
    min_count: int = 50  # sequences a bin needs to enter a fit or a test
    n_boot: int = 200  # bootstrap draws (over prompts) of the std exponent's 95% CI
    random_direction: Optional[float] = None  # eps: also measure S for a random direction each step (+probe=law)


@dataclass
class DiagnosticsConfig:
    """What the fairness diagnostics measure and plot (docs/metrics.md)."""

    bin_width: int = MISSING  # clip-fraction length bin width in tokens (conf: data.length_bin_width)
    max_len: int = MISSING  # the longest length binned (conf: rollout.sampling.max_new_tokens)
    bin_edges: Any = None  # explicit length-bin edges (e.g. geometric); null: bin_width
    lre_min_len: Any = MISSING  # shortest length counted in the LRE (conf: data.lre_min_len)
    reservoir_size: int = 4096  # log-ratio samples kept for the Gaussianity checks
    figure_min_count: int = 20  # plots/clip_fraction_by_length.png leaves out bins with fewer sequences
    law: LawConfig = field(default_factory=LawConfig)  # the length law of the run
    acceptance_on_policy: bool = False  # count the on-policy mini-batch (S = 0) in q(L) and fairness/lre?
    grad_probe_every: int = 0  # every N steps: measured ||g_L||, LRE_w, Theorem 1 cosines (probe/*); 0: off


@dataclass
class MemoryPlanConfig:
    """The per-rank memory plan (weights, grads, optimizer, activations, logits, engine) logged at start-up."""

    check: bool = True  # refuse, before the model loads, a layout above headroom x available memory
    headroom: float = 0.9  # usable fraction (CUDA: the device's memory; CPU: RAM / ranks on the node)
    device_gib: Optional[float] = None  # N: plan for N GiB per rank instead of the detected device (80: an H100)
    auto_fit: bool = True  # a plan that does not fit picks bf16 LoRA base, chunked head, ... until it fits; printed


@dataclass
class ProgressConfig:
    """The console progress (fspo/tracking/progress.py); trainer.enable_progress_bar=false: none."""

    mode: str = "auto"  # auto: a tqdm bar in RL steps on a terminal, else log lines | bar | lines | off
    every_n_steps: int = 5  # lines: one every N RL steps and at the last


@dataclass
class LoraConfig:
    """LoRA adapters, peft (fspo/models/lora.py, docs/lora.md); only they train."""

    rank: int = 0  # r; 0: off (full fine-tuning)
    alpha: Any = 16  # scale alpha / r of B A (a number)
    lr: Optional[float] = 5.0e-4  # AdamW's lr for the adapters (null: ppo.lr)
    dropout: float = 0.0  # on the adapters' input in training passes
    target_modules: Any = None  # linear layers by name (q_proj, ...); null: every one of attention and MLP


@dataclass
class ModelConfig(Dict[str, Any]):
    """The policy: the tiny default; conf/model/*.yaml set the others (and their ``arch:``)."""

    name: str = "tiny"  # the model's name in run names and tags
    source: str = "warmstart"  # warmstart | random | pretrained
    path: Optional[str] = None  # a local HF folder (source=pretrained); null: hub_id
    hub_id: Optional[str] = None  # the Hugging Face hub id
    dtype: str = "float32"  # float32 | bfloat16 | float16: the trainable weights
    layer_class: str = "Qwen3DecoderLayer"  # the decoder layer's class (FSDP units)
    activation_checkpointing: bool = False  # recompute each decoder layer in backward
    device: str = "cpu"  # cpu: as trainer/ says | cuda: on the GPUs found (docs/gpus.md)
    lora: LoraConfig = field(default_factory=LoraConfig)  # LoRA adapters (rank 0: off)


@dataclass
class EvalModelConfig(Dict[str, Any]):
    """evaluate.py's ``model``: the `ModelConfig` keys it reads, with their defaults (conf/model/*.yaml on top)."""

    name: str = ModelConfig.name
    source: str = ModelConfig.source
    path: Optional[str] = ModelConfig.path
    hub_id: Optional[str] = ModelConfig.hub_id
    dtype: str = ModelConfig.dtype
    layer_class: str = ModelConfig.layer_class
    device: str = ModelConfig.device


@dataclass
class RewardGuardConfig:
    """A NaN/inf reward or one failing on every sample stops the run (fspo/rewards/guard.py)."""

    max_error_frac: float = 0.0  # share of a step's samples the reward may raise on (scored 0)


@dataclass
class AggregatorConfig:
    """How token losses become the loss (fspo/losses.py `Aggregator`)."""

    _target_: str = "fspo.losses.Aggregator"
    mode: str = MISSING  # mirror of loss_agg_mode (set that one)


@dataclass
class ValConfig:
    """Validation: val/accuracy is Avg@n on held-out prompts."""

    size: int = 256  # held-out prompts (disjoint from the train split); 0: no validation
    every_n_steps: int = 20  # RL steps between validations
    batch_size: int = 128  # prompts per validation batch
    sampling: VAL_SAMPLING = field(default_factory=VAL_SAMPLING)  # the test-time decoding


@dataclass
class RunConfig(Dict[str, Any]):
    """The run: its top-level keys, in conf/config.yaml's order, after the config groups' nodes."""

    method: str = "fspo"  # the method's name (tags, run names); +method=<name> picks it
    seed: int = 42  # the run's random seed
    run_name: Optional[str] = None  # the MLflow run's name; null: <method>_s<seed>
    output_dir: Optional[str] = None  # null: Hydra's run folder (outputs/<date>/<time>)
    tags: Dict[str, Any] = field(default_factory=dict)  # extra MLflow tags
    cpu_threads: Optional[int] = 1  # torch intra-op threads (null: torch's default)
    logger_fallback: Optional[str] = None  # local: log to sqlite in output_dir if the tracking server is down
    reward_guard: RewardGuardConfig = field(default_factory=RewardGuardConfig)  # the reward's failures
    resume: Optional[str] = None  # auto: the newest good checkpoint in output_dir | fresh | a path
    steps: int = 60  # RL steps (one rollout batch each)
    prompts_per_step: int = 16  # prompts per RL step, x rollout.sampling.n samples
    advantage_mask: Any = None  # advantages kept on some groups only (docs/length_law.md)
    loss_agg_mode: str = "token-mean"  # token-mean | token-sum | seq-mean-token-{mean,sum,sum-norm}
    model: ModelConfig = field(default_factory=ModelConfig)  # the policy
    dry_run: Any = False  # true: print the per-rank memory plan and exit
    memory_plan: MemoryPlanConfig = field(default_factory=MemoryPlanConfig)  # the memory plan
    aggregator: AggregatorConfig = field(default_factory=AggregatorConfig)  # the loss aggregation
    ppo: PPO = field(default_factory=PPO)  # the update
    guard: GUARD = field(default_factory=GUARD)  # the divergence guard
    rollout_correction: CORRECTION = field(default_factory=CORRECTION)  # the mismatch correction
    progress: ProgressConfig = field(default_factory=ProgressConfig)  # the console progress
    diagnostics: DiagnosticsConfig = field(default_factory=DiagnosticsConfig)  # diagnostics
    val: ValConfig = field(default_factory=ValConfig)  # validation
