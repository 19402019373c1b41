"""FSPO as a verl policy loss: importing this module registers ``fspo`` in verl's ``POLICY_LOSS_REGISTRY``.

The loss is fspo.clipping.registry's ``fspo`` as is (settings by ``fspo_settings``; verl's ``clip_ratio*`` are not
read; ``loss_agg_mode``, ``global_batch_info`` and ``rollout_is_weights`` act as in verl's vanilla loss). A running
band (``band: ema | power | per_bin``) keeps one `FSPOClip` per process and setting that observes every call
with a gradient; its state is not in verl's checkpoints. Per length bin the loss adds COUNTS (``actor/fspo/n_seq``,
``n_clip``, ``n_out``/<bin>), because verl averages each pg_metrics key over micro-batches, ranks and
mini-batches, so n_clip / n_seq stays the exact clip fraction. Loading and recipe: docs/integrations.md.
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
from fspo.clipping.registry import FSPO_DEFAULTS, _run_full, fspo_settings, setting  # noqa: E402
from fspo.clipping.settings import FSPOSettings  # noqa: E402
from fspo.diagnostics.bins import LengthBins  # noqa: E402
from fspo.diagnostics.length_counts import BIN_WIDTH, count_metrics, length_counts  # noqa: E402

PREFIX = "actor/fspo"
BIN_MAX = 8192


@dataclass
class FSPOPolicyLossConfig(PolicyLossConfig):
    """verl's PolicyLossConfig with FSPO's settings (paper defaults) and the per-length bins."""

    loss_mode: str = "fspo"
    c_upper: float = FSPO_DEFAULTS["c_upper"]
    c_lower: float = FSPO_DEFAULTS["c_lower"]
    c_dual: Optional[float] = FSPO_DEFAULTS["c_dual"]
    ratio_grad: str = FSPO_DEFAULTS["ratio_grad"]
    length_bin_width: int = BIN_WIDTH
    length_bin_max: int = BIN_MAX
    band: str = FSPOSettings.band  # fixed (c_*) | ema | power | per_bin: FSPO's running bands
    z: float = FSPOSettings.z
    alpha: float = FSPOSettings.alpha
    sigma0: float = FSPOSettings.sigma0
    calibration: Optional[Dict[str, Any]] = None


def length_bins(config: Any) -> LengthBins:
    """The metric bins of ``config`` (``length_bin_width`` / ``length_bin_max``, by registry.setting)."""
    return LengthBins(width=int(setting(config, "length_bin_width", BIN_WIDTH)),
                      max_len=int(setting(config, "length_bin_max", BIN_MAX)))


#: this process's running-band rules, one per distinct setting (the state of ``band`` != fixed)
_RULES: Dict[Tuple, FSPOClip] = {}
BAND_KEYS = ("band", "z", "alpha", "sigma0", "c_dual", "ratio_grad")


def running_rule(config: Any) -> Optional[FSPOClip]:
    """None for ``band: fixed``; else this process's `FSPOClip` for the config's band settings, kept between
    calls."""
    kw = {k: setting(config, k, getattr(FSPOSettings, k)) for k in BAND_KEYS}
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
    """verl's policy-loss signature: (loss, pg_metrics) of the registry's ``fspo`` (or the running band, logging
    ``actor/fspo/sigma_hat``) plus the per-length counts."""
    rule = running_rule(config)
    loss, metrics, res = _run_full(FSPOClip(**fspo_settings(config)) if rule is None else rule.to(log_prob.device),
                                   old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                                   rollout_is_weights=rollout_is_weights)
    if rule is not None:
        metrics[f"{PREFIX}/sigma_hat"] = float(rule.sigma_hat)
        if log_prob.requires_grad:  # a training call (not a metrics-only pass): update the running band
            m = response_mask.bool()
            rule.observe(res.seq_log_ratio, m.sum(-1), (log_prob.detach() - old_log_prob).float() * m, m)
    bins = length_bins(config)
    metrics.update(count_metrics(length_counts(res, response_mask, bins), bins, PREFIX))
    return loss, metrics


def by_length_fractions(metrics: Dict[str, float]) -> Dict[str, float]:
    """``actor/fspo/{clip,out}_frac/<bin>`` = n_clip / n_seq, n_out / n_seq of verl's reduced metrics."""
    out = {}
    for key, n in metrics.items():
        if key.startswith(f"{PREFIX}/n_seq/") and float(n) > 0:
            label = key.rsplit("/", 1)[1]
            for row in ("clip", "out"):
                out[f"{PREFIX}/{row}_frac/{label}"] = float(metrics[f"{PREFIX}/n_{row}/{label}"]) / float(n)
    return out
