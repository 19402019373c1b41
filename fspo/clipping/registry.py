"""verl-compatible policy-loss registry: ``fn(old_log_prob, log_prob, advantages, response_mask,
loss_agg_mode, config) -> (loss, metrics)``, matching verl 0.9.1 (tests/test_verl_parity.py).

Owns: `POLICY_LOSSES`, `register_policy_loss`, `get_policy_loss_fn` and the wrappers that build a
clip rule from verl-style settings, apply it and aggregate. Names here: ``vanilla`` (= ``grpo``),
``grpo``, ``rloo``, ``gspo``, ``fspo``. A rule file may register its own names with
``@register_policy_loss`` (cispo.py: ``cispo``; sapo.py: ``sapo``; gmpo.py: ``geo_mean`` = ``gmpo``;
luspo.py: ``luspo``): importing this module imports every module of fspo.clipping, so a new rule
needs no edit here. ``config`` may be None, a dict, a DictConfig or any object
with verl's field names (a verl ``ActorConfig`` included): ``clip_ratio`` (fallback for both sides),
``clip_ratio_low``, ``clip_ratio_high``, ``clip_ratio_c``; for fspo ``c_upper``, ``c_lower``,
``c_dual``; for fspo and rloo ``ratio_grad`` ("per_token" | "length_weighted", passed to the rule
only when set). Unset fields take the paper's values for that method. Every name aggregates with
``loss_agg_mode`` (fspo/losses.py; gspo's default argument is seq-mean-token-mean, as in verl).
``rollout_is_weights`` (optional, verl's keyword; [B, T] or broadcastable, e.g. TRL's [B, 1]) multiplies
the per-token loss before aggregation, as verl's vanilla applies its rollout correction.
``config.global_batch_info`` (verl's dict: ``dp_size``, ``batch_num_tokens``, ``global_batch_size``,
``loss_scale_factor``; empty by default) sets the aggregation's ``total_tokens``, ``total_seqs`` and
``norm_len`` and multiplies the loss by ``dp_size``, as verl's `agg_loss` does.
Metrics (python floats, masked token means): ``actor/pg_clipfrac`` (upper or lower clip binds),
``actor/ppo_kl`` (mean of logp_old - logp_new, clamped to +-20 like verl's vanilla except for gspo),
``actor/pg_clipfrac_lower`` (verl's name for the dual-clip fraction; 0 for gspo).
FSPO's settings are read by `fspo_settings` (``FSPO_KEYS``, defaults ``FSPO_DEFAULTS``: the paper's),
the one mapping fspo/integrations/verl.py and trl.py share: each key by `setting`, from
``config.policy_loss`` (verl's sub-config), else ``config`` itself, else the paper's value; a key present with value
None is passed on (``c_dual=None`` turns the dual clip off). verl's ``clip_ratio*`` are ratio-space GRPO settings and
are not read for fspo. `fspo_loss` is ``fspo`` returning the `ClipResult` too (per-length diagnostics). Leaves out:
stateful running estimates (FSPO's EMA band needs the `FSPOClip` module itself).
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import torch
from torch import Tensor

from fspo.clipping._common import MAX_LOG_RATIO
from fspo.clipping.base import ClipResult, ClipRule
from fspo.clipping.fspo import FSPOClip
from fspo.clipping.grpo import GRPOClip
from fspo.clipping.gspo import GSPOClip
from fspo.clipping.rloo import RLOOClip
from fspo.losses import aggregate

PolicyLossFn = Callable[..., Tuple[Tensor, Dict[str, float]]]
POLICY_LOSSES: Dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Decorator registering a policy-loss function under ``name``."""
    def deco(fn: PolicyLossFn) -> PolicyLossFn:
        POLICY_LOSSES[name] = fn
        return fn
    return deco


def get_policy_loss_fn(name: str) -> PolicyLossFn:
    """The policy loss registered as ``name``; ValueError listing the names otherwise."""
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r}; choose one of {sorted(POLICY_LOSSES)}")
    return POLICY_LOSSES[name]


def _get(config: Any, key: str) -> Optional[Any]:
    if config is None:
        return None
    if isinstance(config, dict):
        return config.get(key)
    try:
        return getattr(config, key)
    except AttributeError:
        return None


def _ratio_kwargs(config: Any, defaults: Dict[str, Optional[float]]) -> Dict[str, Optional[float]]:
    both = _get(config, "clip_ratio")
    out = {}
    for key, default in defaults.items():
        v = _get(config, key)
        v = both if v is None and key != "clip_ratio_c" else v
        out[key] = default if v is None else v
    return out


def _masked_mean(x: Tensor, mask: Tensor) -> float:
    return float((x.float() * mask).sum() / mask.sum().clamp(min=1.0))


def _seq_kwargs(config: Any) -> Dict[str, Any]:
    """FSPOClip / RLOOClip keyword ``ratio_grad`` from ``config``, only when set."""
    v = _get(config, "ratio_grad")
    return {} if v is None else {"ratio_grad": v}


def _batch_info(config: Any, mode: str) -> Tuple[Dict[str, Any], Any]:
    """verl's ``global_batch_info`` as `aggregate` keywords, and its ``dp_size`` (default 1).

    As in verl, dp_size > 1 requires the global denominator ``mode`` uses (ValueError otherwise)."""
    info = _get(config, "global_batch_info") or {}
    totals = {"total_tokens": _get(info, "batch_num_tokens"), "total_seqs": _get(info, "global_batch_size"),
              "norm_len": _get(info, "loss_scale_factor")}
    dp = _get(info, "dp_size")
    dp = 1 if dp is None else dp
    need = ("batch_num_tokens" if mode == "token-mean" else
            "global_batch_size" if mode.startswith("seq-mean") else None)
    if dp != 1 and need is not None and _get(info, need) is None:
        raise ValueError(f"global_batch_info: {need} is required with loss_agg_mode {mode!r} when "
                         f"dp_size > 1 (got dp_size={dp!r})")
    return totals, dp


def _run(rule: ClipRule, old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor,
         response_mask: Tensor, mode: str, config: Any, kl_clamp: Optional[float] = MAX_LOG_RATIO,
         metrics_fn: Optional[Callable[[ClipResult, Tensor], Dict[str, float]]] = None,
         rollout_is_weights: Optional[Tensor] = None) -> Tuple[Tensor, Dict[str, float]]:
    """Apply ``rule``, aggregate with ``mode`` and verl's batch info; ``metrics_fn(result, mask)``
    (optional) overrides entries of the default metrics where a rule reports verl's differently."""
    loss, metrics, _ = _run_full(rule, old_log_prob, log_prob, advantages, response_mask, mode, config,
                                 kl_clamp, metrics_fn, rollout_is_weights)
    return loss, metrics


def _run_full(rule: ClipRule, old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor,
              response_mask: Tensor, mode: str, config: Any, kl_clamp: Optional[float] = MAX_LOG_RATIO,
              metrics_fn: Optional[Callable[[ClipResult, Tensor], Dict[str, float]]] = None,
              rollout_is_weights: Optional[Tensor] = None) -> Tuple[Tensor, Dict[str, float], ClipResult]:
    """`_run` that also returns the rule's `ClipResult` (its ``token_loss`` without the IS weights)."""
    totals, dp = _batch_info(config, mode)
    res = rule(log_prob, old_log_prob, advantages, response_mask)
    m = response_mask.bool().float()
    token_loss = res.token_loss
    if rollout_is_weights is not None:
        try:
            shape = torch.broadcast_shapes(rollout_is_weights.shape, token_loss.shape)
        except RuntimeError:
            shape = None
        if shape != token_loss.shape:
            raise ValueError(f"rollout_is_weights shape {tuple(rollout_is_weights.shape)} does not broadcast to "
                             f"the response shape {tuple(token_loss.shape)}")
        token_loss = token_loss * rollout_is_weights.to(token_loss.dtype)
    loss = aggregate(token_loss, response_mask, mode, **totals).loss
    if dp != 1:
        loss = loss * dp
    d = torch.where(m.bool(), log_prob.detach().float() - old_log_prob.float(), 0.0)
    if kl_clamp is not None:  # verl's vanilla reports the clamped log-ratio, its gspo the raw one
        d = d.clamp(-kl_clamp, kl_clamp)
    metrics = {"actor/pg_clipfrac": _masked_mean(res.clip_upper | res.clip_lower, m),
               "actor/ppo_kl": _masked_mean(-d, m),
               "actor/pg_clipfrac_lower": _masked_mean(res.clip_dual, m)}
    if metrics_fn is not None:
        metrics.update(metrics_fn(res, m))
    return loss, metrics, res


@register_policy_loss("vanilla")
@register_policy_loss("grpo")
def policy_loss_grpo(old_log_prob, log_prob, advantages, response_mask,
                     loss_agg_mode: str = "token-mean", config: Any = None):
    """GRPO / verl vanilla: `GRPOClip` (token ratio clip 0.2 / 0.28, dual 3.0) + `aggregate`."""
    rule = GRPOClip(**_ratio_kwargs(config, {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28,
                                             "clip_ratio_c": 3.0}))
    return _run(rule, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config)


@register_policy_loss("rloo")
def policy_loss_rloo(old_log_prob, log_prob, advantages, response_mask,
                     loss_agg_mode: str = "token-mean", config: Any = None):
    """RLOO: `RLOOClip` (sequence ratio clip 0.4 / 0.667, dual 3.0; ``ratio_grad``) + `aggregate`."""
    rule = RLOOClip(**_ratio_kwargs(config, {"clip_ratio_low": 0.4, "clip_ratio_high": 0.667,
                                             "clip_ratio_c": 3.0}), **_seq_kwargs(config))
    return _run(rule, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config)


@register_policy_loss("gspo")
def policy_loss_gspo(old_log_prob, log_prob, advantages, response_mask,
                     loss_agg_mode: str = "seq-mean-token-mean", config: Any = None):
    """GSPO: `GSPOClip` (clip 3e-4 / 4e-4, no dual) + `aggregate` with ``loss_agg_mode`` (verl 0.9.1
    honours it; its default, seq-mean-token-mean, is the GSPO paper's)."""
    rule = GSPOClip(**_ratio_kwargs(config, {"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4}))
    return _run(rule, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                kl_clamp=None)


#: FSPO's stateless settings the registry reads, and their defaults: the paper's (Table 4) values
FSPO_KEYS = ("c_upper", "c_lower", "c_dual", "ratio_grad")
FSPO_DEFAULTS: Dict[str, Any] = {
    k: p.default for k, p in inspect.signature(FSPOClip.__init__).parameters.items() if k in FSPO_KEYS}
_MISSING = object()


def _lookup(config: Any, key: str) -> Any:
    """``config[key]`` / ``config.key`` as given (None included), or `_MISSING` where absent."""
    if config is None:
        return _MISSING
    if isinstance(config, Mapping) or hasattr(config, "keys") and hasattr(config, "get"):
        try:
            return config[key] if key in config else _MISSING
        except (AttributeError, KeyError, TypeError):
            return _MISSING
    return getattr(config, key, _MISSING)


def setting(config: Any, key: str, default: Any = None) -> Any:
    """``key`` from ``config.policy_loss`` (verl's sub-config), else from ``config``, else ``default``;
    a key present with value None gives None."""
    sub = _lookup(config, "policy_loss")
    v = _MISSING if sub is _MISSING or sub is None else _lookup(sub, key)
    v = _lookup(config, key) if v is _MISSING else v
    return default if v is _MISSING else v


def fspo_settings(config: Any) -> Dict[str, Any]:
    """FSPOClip keyword arguments from a verl-style ``config``: each of ``FSPO_KEYS`` by `setting`,
    defaulting to ``FSPO_DEFAULTS`` (the paper's)."""
    return {key: setting(config, key, FSPO_DEFAULTS[key]) for key in FSPO_KEYS}


def fspo_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode: str = "token-mean",
              config: Any = None, rollout_is_weights: Optional[Tensor] = None
              ) -> Tuple[Tensor, Dict[str, float], ClipResult]:
    """``fspo`` (below) returning its `ClipResult` as well: the adapters' per-length diagnostics."""
    rule = FSPOClip(**fspo_settings(config))
    return _run_full(rule, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                     rollout_is_weights=rollout_is_weights)


@register_policy_loss("fspo")
def policy_loss_fspo(old_log_prob, log_prob, advantages, response_mask,
                     loss_agg_mode: str = "token-mean", config: Any = None,
                     rollout_is_weights: Optional[Tensor] = None):
    """FSPO with a fixed band: `FSPOClip(**fspo_settings(config))` (paper: c_upper = c_lower = c_dual
    = 0.03; ``ratio_grad``) + `aggregate`, the token loss times ``rollout_is_weights`` when given."""
    loss, metrics, _ = fspo_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                                 rollout_is_weights)
    return loss, metrics


def _import_rule_modules() -> None:
    """Import every module of fspo.clipping, so the policy losses that rule files register themselves
    (``@register_policy_loss`` beside their rule) are listed. Runs last: a rule file importing this
    module mid-import finds every name above already defined."""
    import importlib
    import pkgutil

    import fspo.clipping as package
    for info in pkgutil.iter_modules(package.__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"{package.__name__}.{info.name}")


_import_rule_modules()
