"""The root's plain settings groups as typed schemas: their keys, types, defaults and one-line docs, stated once.

Owns: `DiagnosticsConfig` (``diagnostics:``, with `LawConfig`), `MemoryPlanConfig` (``memory_plan:``) and
`ProgressConfig` (``progress:``), stored by fspo/config. conf/config.yaml keeps only their interpolations.
Leaves out: the value ranges (fspo/runtime/checks/config_rules.py checks them before anything loads) and the code
that reads them (fspo/diagnostics, fspo/runtime/launch/memory_plan.py, fspo/tracking/progress.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING


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
