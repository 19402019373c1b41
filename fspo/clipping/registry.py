"""verl-compatible policy-loss registry: ``fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
config) -> (loss, metrics)``, matching verl 0.9.1 (tests/test_verl_parity.py). Rule files register their own
names (importing this module imports them all). ``config`` (None, dict, DictConfig or verl's config object)
gives verl's ``clip_ratio`` (both sides), ``clip_ratio_low/high/c``, ``ratio_grad``; unset fields take the
rule's defaults. FSPO reads ``FSPO_KEYS`` by `setting` (a key present as None is passed on: ``c_dual=None``
turns the dual clip off), never the ratio-space ``clip_ratio*``. ``rollout_is_weights`` multiply the token loss
before `aggregate`; ``config.global_batch_info`` sets the totals and ``dp_size`` as verl's `agg_loss`. Metrics
(masked token means): ``actor/pg_clipfrac`` (upper or lower), ``actor/ppo_kl`` (logp_old - logp_new, clamped
to +-20 except for gspo), ``actor/pg_clipfrac_lower`` (dual).
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


def _get(config: Any, key: str) -> Optional[Any]:
    """``config[key]`` / ``config.key``, None where absent."""
    v = _lookup(config, key)
    return None if v is _MISSING else v


def _defaults(cls: type, keys) -> Dict[str, Any]:
    """The defaults of ``cls.__init__``'s parameters named in ``keys`` (stated once, in the signature)."""
    return {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items() if k in keys}


def _ratio_kwargs(config: Any, rule: type) -> Dict[str, Optional[float]]:
    """verl's ``clip_ratio_low/high/c`` for ``rule``: each as set, ``clip_ratio`` for an unset side, else the
    rule's default."""
    both = _get(config, "clip_ratio")
    out = {}
    for key, default in _defaults(rule, ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c")).items():
        v = _get(config, key)
        v = both if v is None and key != "clip_ratio_c" else v
        out[key] = default if v is None else v
    return out


def _masked_mean(x: Tensor, mask: Tensor) -> float:
    return float((x.float() * mask).sum() / mask.sum().clamp(min=1.0))


def _batch_info(config: Any, mode: str) -> Tuple[Dict[str, Any], Any]:
    """verl's ``global_batch_info`` as `aggregate` keywords, and its ``dp_size`` (1); dp_size > 1 needs the global
    denominator ``mode`` uses (ValueError otherwise)."""
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


def _run_full(rule: ClipRule, old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor,
              response_mask: Tensor, mode: str, config: Any, kl_clamp: Optional[float] = MAX_LOG_RATIO,
              rollout_is_weights: Optional[Tensor] = None) -> Tuple[Tensor, Dict[str, float], ClipResult]:
    """Apply ``rule``, weight by ``rollout_is_weights``, aggregate with ``mode`` and verl's batch info; returns
    (loss, metrics, `ClipResult`)."""
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
    return loss, metrics, res


def rule_loss(*names: str, mode: Optional[str] = None, default_mode: str = "token-mean",
              kl_clamp: Optional[float] = MAX_LOG_RATIO, metrics: Optional[Callable[..., Dict[str, float]]] = None
              ) -> Callable[[Callable[[Any], ClipRule]], PolicyLossFn]:
    """Decorator turning ``build(config) -> rule`` into a policy loss registered under ``names`` (docstring kept):
    `_run_full` with ``mode`` (None: the caller's ``loss_agg_mode``, default ``default_mode``) and ``kl_clamp``;
    ``metrics(result, mask, rule, old_log_prob, log_prob, advantages, response_mask)`` overrides metrics."""
    def deco(build: Callable[[Any], ClipRule]) -> PolicyLossFn:
        def fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode: str = default_mode,
               config: Any = None, rollout_is_weights: Optional[Tensor] = None):
            rule = build(config)
            loss, out, res = _run_full(rule, old_log_prob, log_prob, advantages, response_mask, mode or loss_agg_mode,
                                       config, kl_clamp, rollout_is_weights)
            if metrics is not None:
                out.update(metrics(res, response_mask.bool().float(), rule, old_log_prob, log_prob, advantages,
                                   response_mask))
            return loss, out
        fn.__name__, fn.__doc__ = build.__name__, build.__doc__
        for name in names:
            register_policy_loss(name)(fn)
        return fn
    return deco


@rule_loss("vanilla", "grpo")
def policy_loss_grpo(config: Any) -> ClipRule:
    """GRPO / verl vanilla: `GRPOClip` (0.2 / 0.28, dual 3.0)."""
    return GRPOClip(**_ratio_kwargs(config, GRPOClip))


@rule_loss("rloo")
def policy_loss_rloo(config: Any) -> ClipRule:
    """RLOO: `RLOOClip` (0.4 / 0.667, dual 3.0; ``ratio_grad``)."""
    grad = _get(config, "ratio_grad")
    return RLOOClip(**_ratio_kwargs(config, RLOOClip), **({} if grad is None else {"ratio_grad": grad}))


@rule_loss("gspo", default_mode="seq-mean-token-mean", kl_clamp=None)
def policy_loss_gspo(config: Any) -> ClipRule:
    """GSPO: `GSPOClip` (3e-4 / 4e-4, no dual); default mode seq-mean-token-mean, as verl."""
    return GSPOClip(**_ratio_kwargs(config, GSPOClip))


#: FSPO's stateless settings and their defaults, the paper's (Table 4)
FSPO_KEYS = ("c_upper", "c_lower", "c_dual", "ratio_grad")
FSPO_DEFAULTS: Dict[str, Any] = _defaults(FSPOClip, FSPO_KEYS)


def setting(config: Any, key: str, default: Any = None) -> Any:
    """``key`` from ``config.policy_loss``, else ``config``, else ``default``; present as None gives None."""
    sub = _lookup(config, "policy_loss")
    v = _MISSING if sub is _MISSING or sub is None else _lookup(sub, key)
    v = _lookup(config, key) if v is _MISSING else v
    return default if v is _MISSING else v


def fspo_settings(config: Any) -> Dict[str, Any]:
    """FSPOClip keyword arguments from a verl-style ``config`` (``FSPO_KEYS`` by `setting`)."""
    return {key: setting(config, key, FSPO_DEFAULTS[key]) for key in FSPO_KEYS}


def fspo_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode: str = "token-mean",
              config: Any = None, rollout_is_weights: Optional[Tensor] = None
              ) -> Tuple[Tensor, Dict[str, float], ClipResult]:
    """``fspo`` returning its `ClipResult` too (what per-length diagnostics need)."""
    rule = FSPOClip(**fspo_settings(config))
    return _run_full(rule, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                     rollout_is_weights=rollout_is_weights)


@rule_loss("fspo")
def policy_loss_fspo(config: Any) -> ClipRule:
    """FSPO, fixed band: `FSPOClip(**fspo_settings(config))` (paper: 0.03 each; ``ratio_grad``)."""
    return FSPOClip(**fspo_settings(config))


def _import_rule_modules() -> None:
    """Import every rule module (they register themselves); runs last, so they find the names above."""
    import importlib
    import pkgutil

    import fspo.clipping as package
    for info in pkgutil.iter_modules(package.__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"{package.__name__}.{info.name}")


_import_rule_modules()
