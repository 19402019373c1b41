"""FSPO as a verl policy loss: importing this module registers ``fspo`` in verl's registry.

Owns: the registration (`compute_policy_loss_fspo` in verl.trainer.ppo.core_algos's
``POLICY_LOSS_REGISTRY``), `FSPOPolicyLossConfig` (verl's PolicyLossConfig plus FSPO's settings,
for ``actor_rollout_ref.actor.policy_loss._target_``), the per-length metrics it adds to verl's
``pg_metrics`` and `by_length_fractions` (those metrics, after verl's reduction, as fractions).
Leaves out: the loss itself (fspo.clipping.registry's ``fspo``, called as is: one implementation).
FSPO's running bands (``band: ema | power | per_bin`` with ``z``, ``alpha``, ``sigma0``, ``calibration``, as
conf/clip/fspo_*.yaml) keep one `FSPOClip` per process and setting (`running_rule`) that observes every call with a
gradient (each micro-batch; every rank all-reduces its statistics); that state is not in verl's checkpoints
(a resumed job restarts it from ``sigma0``).

Loading, in every verl process (driver and Ray workers): ``VERL_USE_EXTERNAL_MODULES=fspo.integrations.verl``
(verl/__init__.py imports the modules listed there) or ``actor_rollout_ref.model.external_lib=
fspo.integrations.verl`` (verl's HFModelConfig imports it); ``policy_loss._target_`` naming
`FSPOPolicyLossConfig` also imports it wherever the actor config is built. Then
``actor_rollout_ref.actor.policy_loss.loss_mode=fspo``. verl range: requirements.SUPPORTED.

Settings (fspo.clipping.registry.fspo_settings, the one mapping, shared with our own registry):
``c_upper``, ``c_lower``, ``c_dual``, ``ratio_grad`` from ``actor.policy_loss`` (an
`FSPOPolicyLossConfig`), defaults the paper's (0.03 each, per-token gradient). verl's
``clip_ratio*`` are ratio-space GRPO settings and are not read. ``loss_agg_mode``,
``global_batch_info`` and ``rollout_is_weights`` (verl's rollout correction) act exactly as in verl's
vanilla loss.

Per-length metrics (fspo/diagnostics/length_counts.py), for EVERY bin of
``length_bin_width`` (200, the paper's) up to ``length_bin_max`` (8192) plus an overflow bin:
``actor/fspo/n_seq/<bin>``, ``actor/fspo/n_clip/<bin>`` (binding clips), ``actor/fspo/n_out/<bin>``
(outside the band: the paper's c(L)). They are COUNTS, because verl averages each pg_metrics key
over micro-batches, then over data-parallel ranks, then over mini-batches (Metric MEAN in
verl/workers/utils/losses.py, Metric.aggregate_dp, reduce_metrics): every key is present in every
call, so each logged value is the same average of the per-call counts, and n_clip / n_seq is exactly
the clip fraction of the step's sequences in that bin (exact when every mini-batch has the same
number of micro-batches, as with a fixed micro-batch size; with use_dynamic_bsz a mini-batch's
counts are weighted by 1 / its number of micro-batches). `by_length_fractions` turns a reduced
metrics dict into ``actor/fspo/clip_frac/<bin>`` and ``actor/fspo/out_frac/<bin>``.
"""
from __future__ import annotations

from fspo.integrations.requirements import require

require("verl")

from dataclasses import dataclass  # noqa: E402
from typing import Any, Dict, Optional, Tuple  # noqa: E402

from torch import Tensor  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.workers.config import PolicyLossConfig  # noqa: E402

from fspo.clipping.fspo import FSPOClip  # noqa: E402
from fspo.clipping.registry import FSPO_DEFAULTS, _run_full, fspo_loss, setting  # noqa: E402
from fspo.diagnostics.bins import LengthBins  # noqa: E402
from fspo.diagnostics.length_counts import count_metrics, length_counts  # noqa: E402

PREFIX = "actor/fspo"
BIN_WIDTH, BIN_MAX = 200, 8192


@dataclass
class FSPOPolicyLossConfig(PolicyLossConfig):
    """verl's PolicyLossConfig with FSPO's settings (paper defaults) and the per-length bins.
    Use: ``actor_rollout_ref.actor.policy_loss._target_=fspo.integrations.verl.FSPOPolicyLossConfig``."""

    loss_mode: str = "fspo"
    c_upper: float = FSPO_DEFAULTS["c_upper"]
    c_lower: float = FSPO_DEFAULTS["c_lower"]
    c_dual: Optional[float] = FSPO_DEFAULTS["c_dual"]
    ratio_grad: str = FSPO_DEFAULTS["ratio_grad"]
    length_bin_width: int = BIN_WIDTH
    length_bin_max: int = BIN_MAX
    band: str = "fixed"  # fixed (c_*) | ema | power | per_bin: FSPO's running bands (module docstring)
    z: float = 1.0
    alpha: float = 0.1
    sigma0: float = 0.03
    calibration: Optional[Dict[str, Any]] = None


def length_bins(config: Any) -> LengthBins:
    """The metric bins of ``config`` (``length_bin_width`` / ``length_bin_max``, by registry.setting)."""
    return LengthBins(width=int(setting(config, "length_bin_width", BIN_WIDTH)),
                      max_len=int(setting(config, "length_bin_max", BIN_MAX)))


#: this process's running-band rules, one per distinct setting (the state of ``band`` != fixed)
_RULES: Dict[Tuple, FSPOClip] = {}
BAND_KEYS = ("band", "z", "alpha", "sigma0", "c_dual", "ratio_grad")


def running_rule(config: Any) -> Optional[FSPOClip]:
    """None for ``band: fixed``; else this process's `FSPOClip` for the config's band settings (created once,
    then kept: its sigma_hat / calibrator moments carry over between calls)."""
    kw = {k: setting(config, k, d) for k, d in zip(BAND_KEYS, ("fixed", 1.0, 0.1, 0.03, FSPO_DEFAULTS["c_dual"],
                                                              FSPO_DEFAULTS["ratio_grad"]))}
    if kw["band"] == "fixed":
        return None
    calibration = setting(config, "calibration", None)
    key = (*kw.values(), repr(sorted(dict(calibration or {}).items())))
    if key not in _RULES:
        _RULES[key] = FSPOClip(**kw, calibration=dict(calibration) if calibration else None)
    return _RULES[key]


@core_algos.register_policy_loss("fspo")
def compute_policy_loss_fspo(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor,
                             response_mask: Tensor, loss_agg_mode: str = "token-mean", config: Any = None,
                             rollout_is_weights: Optional[Tensor] = None):
    """verl's policy-loss signature; (loss, pg_metrics) = fspo.clipping.registry's ``fspo`` plus the
    per-length counts (module docstring); with a running band, that band, observing every call that
    carries a gradient (``actor/fspo/sigma_hat`` logged)."""
    rule = running_rule(config)
    if rule is None:
        loss, metrics, res = fspo_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                                       rollout_is_weights)
    else:
        rule.to(log_prob.device)
        loss, metrics, res = _run_full(rule, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
                                       config, rollout_is_weights=rollout_is_weights)
        metrics[f"{PREFIX}/sigma_hat"] = float(rule.sigma_hat)
        if log_prob.requires_grad:  # a training call (not a metrics-only pass): update the running band
            m = response_mask.bool()
            rule.observe(res.seq_log_ratio, m.sum(-1), (log_prob.detach() - old_log_prob).float() * m, m)
    bins = length_bins(config)
    metrics.update(count_metrics(length_counts(res, response_mask, bins), bins, PREFIX))
    return loss, metrics


def by_length_fractions(metrics: Dict[str, float]) -> Dict[str, float]:
    """``actor/fspo/{clip,out}_frac/<bin>`` = n_clip / n_seq, n_out / n_seq from verl's reduced
    metrics (bins with n_seq > 0)."""
    out = {}
    for key, n in metrics.items():
        if key.startswith(f"{PREFIX}/n_seq/") and float(n) > 0:
            label = key.rsplit("/", 1)[1]
            for row in ("clip", "out"):
                out[f"{PREFIX}/{row}_frac/{label}"] = float(metrics[f"{PREFIX}/n_{row}/{label}"]) / float(n)
    return out
