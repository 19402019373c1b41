"""The clip rules' settings as plain values, checked without torch: each rule's defaults and ranges, once.

Owns: `check_positive` and `check_choice` (one ValueError naming the setting); one settings dataclass per rule:
its fields the rule's arguments with defaults and docs (conf/clip/'s schemas), its ``__post_init__`` the rule's
argument check; `SETTINGS` (``clip._target_`` -> class) and `settings_error` (a ``clip:`` node checked early).
Imports no torch. Leaves out: the rules themselves.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Mapping, Optional

RATIO_GRADS = ("per_token", "length_weighted")
#: the loss value forms of rules whose verl value is not -A at the old policy (CISPO, SAPO): ``surrogate``
#: (-A on-policy, like every rule here) or ``verl`` (verl 0.9.1's literal value); the gradient is the same
VALUE_FORMS = ("surrogate", "verl")
FSPO_BANDS = ("fixed", "ema", "power", "per_bin", "quantile", "affine")  # fixed, ema + fspo.py's CALIBRATORS
FSPO_DRIFTS = ("zero", "kl")
DIVERGENCES = ("tv", "kl")  # DPPO's and CPPO's token divergence
BUDGETS = ("prefix_mean", "none")  # CPPO's prefix budget
LENGTH_SCALES = ("none", "sqrt")  # VESPO's kernel input
RATIO_MODES = ("cumprod", "geomean")  # CTPO's sequence ratio
ACCEPTANCES = ("prefix", "last")  # CTPO's acceptance


def check_positive(owner: str, name: str, value: float, *, allow_zero: bool = False) -> float:
    """Return float(value); raise ValueError naming ``owner.name`` if value < 0 (or == 0)."""
    v = float(value)
    if not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{owner}: {name} must be {bound} and finite, got {v:g}")
    return v


def check_choice(owner: str, name: str, value: str, allowed: Iterable[str]) -> str:
    """Return value if it is one of ``allowed``; else ValueError naming the setting and the options."""
    allowed = sorted(allowed)
    if value not in allowed:
        raise ValueError(f"{owner}: {name} must be one of {allowed}, got {value!r}")
    return value


@dataclass
class FSPOSettings:
    """FSPOClip's settings (conf/clip/fspo*.yaml; the paper's Table 4 values)."""

    c_upper: float = 0.03  # upper band scale: mu_L + c_upper sqrt(L)
    c_lower: float = 0.03  # lower band scale: mu_L - c_lower sqrt(L)
    c_dual: Optional[float] = 0.03  # dual clip for A < 0 at mu_L + c_dual sqrt(L) (>= c_upper); null: off
    band: str = "fixed"  # fixed | ema | power | per_bin | quantile | affine
    drift: str = "zero"  # zero | kl (mu_L = -kl_bar L from the running k3 KL estimate)
    z: float = 1.0  # band width in running sigmas (band=ema and the calibrated bands)
    alpha: float = 0.1  # EMA rate of sigma_hat / kl_bar, in (0, 1]
    sigma0: float = 0.03  # EMA warm start of sigma_hat
    ratio_grad: str = "per_token"  # per_token (the paper's, verl's form) | length_weighted (comparison only)
    calibration: Optional[Dict[str, Any]] = None  # the calibrated band's own settings (fspo/clipping/calibration.py)
    owner: str = "FSPOClip"  # the rule named in the messages

    def __post_init__(self) -> None:
        own = self.owner
        self.ratio_grad = check_choice(own, "ratio_grad", self.ratio_grad, RATIO_GRADS)
        self.c_upper = check_positive(own, "c_upper", self.c_upper)
        self.c_lower = check_positive(own, "c_lower", self.c_lower)
        if self.c_dual is not None:
            check_positive(own, "c_dual", self.c_dual)
            if float(self.c_dual) < self.c_upper:
                raise ValueError(f"{own}: c_dual ({float(self.c_dual):g}) must be >= c_upper ({self.c_upper:g}) so the "
                                 f"dual bound is never inside the band; or null to disable it")
            self.c_dual = float(self.c_dual)
        self.band = check_choice(own, "band", self.band, FSPO_BANDS)
        self.drift = check_choice(own, "drift", self.drift, FSPO_DRIFTS)
        self.z = check_positive(own, "z", self.z)
        a = float(self.alpha)
        if not 0.0 < a <= 1.0:
            raise ValueError(f"{own}: alpha must be in (0, 1], got {self.alpha!r}")
        self.alpha = a
        self.sigma0 = check_positive(own, "sigma0", self.sigma0)


@dataclass
class GSPOSettings:
    """The ratio band of the ratio-space rules (verl's names; GSPO's and LUSPO's values): ``clip_ratio_low`` in
    [0, 1) (the ratio floor 1 - low stays positive), ``clip_ratio_high`` >= 0."""

    clip_ratio_low: float = 3e-4  # the ratio floor is 1 - clip_ratio_low, in [0, 1)
    clip_ratio_high: float = 4e-4  # the ratio ceiling is 1 + clip_ratio_high, >= 0
    owner: str = field(default="RatioClipRule", kw_only=True)  # the rule named in the messages

    def __post_init__(self) -> None:
        own, low = self.owner, self.clip_ratio_low
        self.clip_ratio_low = check_positive(own, "clip_ratio_low", low, allow_zero=True)
        if self.clip_ratio_low >= 1.0:
            raise ValueError(f"{own}: clip_ratio_low must be < 1 (the ratio floor 1 - clip_ratio_low "
                             f"must stay > 0), got {low!r}")
        self.clip_ratio_high = check_positive(own, "clip_ratio_high", self.clip_ratio_high, allow_zero=True)


@dataclass
class RatioClipSettings(GSPOSettings):
    """GRPOClip's settings (conf/clip/grpo.yaml; DAPO's clip-higher, verl's dual clip): the band and ``clip_ratio_c``
    > 1 or null (dual clip off)."""

    clip_ratio_low: float = 0.2  # the ratio floor is 1 - clip_ratio_low, in [0, 1)
    clip_ratio_high: float = 0.28  # the ratio ceiling is 1 + clip_ratio_high, >= 0
    clip_ratio_c: Optional[float] = 3.0  # dual clip for A < 0 at this ratio (> 1); null: off

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.clip_ratio_c is not None and not float(self.clip_ratio_c) > 1.0:
            raise ValueError(f"{self.owner}: clip_ratio_c (dual clip) must be > 1 or null, got {self.clip_ratio_c!r}")
        self.clip_ratio_c = None if self.clip_ratio_c is None else float(self.clip_ratio_c)


@dataclass
class RLOOSettings(RatioClipSettings):
    """RLOOClip's settings (conf/clip/rloo.yaml): GRPO's on the sequence ratio exp(S), and its gradient form."""

    clip_ratio_low: float = 0.4  # the ratio floor is 1 - clip_ratio_low, in [0, 1)
    clip_ratio_high: float = 0.667  # the ratio ceiling is 1 + clip_ratio_high, >= 0
    ratio_grad: str = "per_token"  # per_token: the paper's sequence weight (verl form) | length_weighted: L_i x that

    def __post_init__(self) -> None:
        super().__post_init__()
        self.ratio_grad = check_choice(self.owner, "ratio_grad", self.ratio_grad, RATIO_GRADS)


@dataclass
class CISPOSettings:
    """CISPOClip's settings (conf/clip/cispo.yaml): the detached token weight is clipped to
    [1 - clip_ratio_low, 1 + clip_ratio_high]."""

    clip_ratio_low: float = 1.0  # in [0, 1]; 1: no floor (the paper's)
    clip_ratio_high: float = 0.28  # >= 0
    value: str = "surrogate"  # surrogate | verl (the loss value reported; the gradient is the same)
    owner: str = "CISPOClip"  # the rule named in the messages

    def __post_init__(self) -> None:
        own, low = self.owner, self.clip_ratio_low
        self.clip_ratio_low = check_positive(own, "clip_ratio_low", low, allow_zero=True)
        if self.clip_ratio_low > 1.0:
            raise ValueError(f"{own}: clip_ratio_low must be in [0, 1] (the weight floor 1 - clip_ratio_low "
                             f"must stay >= 0; 1 means no floor), got {low!r}")
        self.clip_ratio_high = check_positive(own, "clip_ratio_high", self.clip_ratio_high, allow_zero=True)
        self.value = check_choice(own, "value", self.value, VALUE_FORMS)


@dataclass
class SAPOSettings:
    """SAPOClip's settings (conf/clip/sapo.yaml): the soft gate's temperatures for A > 0 and A < 0."""

    tau_pos: float = 1.0  # > 0
    tau_neg: float = 1.05  # > 0
    value: str = "surrogate"  # surrogate | verl
    owner: str = "SAPOClip"  # the rule named in the messages

    def __post_init__(self) -> None:
        self.tau_pos = check_positive(self.owner, "tau_pos", self.tau_pos)
        self.tau_neg = check_positive(self.owner, "tau_neg", self.tau_neg)
        self.value = check_choice(self.owner, "value", self.value, VALUE_FORMS)


@dataclass
class GMPOSettings:
    """GMPOClip's settings (conf/clip/gmpo.yaml): the token log-ratio clip [-clip_ratio_low, clip_ratio_high]."""

    clip_ratio_low: float = 0.4  # > 0
    clip_ratio_high: float = 0.4  # > 0
    owner: str = "GMPOClip"  # the rule named in the messages

    def __post_init__(self) -> None:
        self.clip_ratio_low = check_positive(self.owner, "clip_ratio_low", self.clip_ratio_low)
        self.clip_ratio_high = check_positive(self.owner, "clip_ratio_high", self.clip_ratio_high)


@dataclass
class DPPOSettings:
    """DPPOClip's settings (conf/clip/dppo.yaml): the per-token divergence band and its dual clip."""

    divergence: str = "tv"  # tv | kl: the token divergence bounded by the band
    clip_ratio_low: float = 0.2  # >= 0: the band below
    clip_ratio_high: float = 0.2  # >= 0: the band above
    clip_ratio_c: float = 20.0  # > 0: the dual clip for A < 0
    value: str = "surrogate"  # surrogate | verl
    owner: str = "DPPOClip"  # the rule named in the messages

    def __post_init__(self) -> None:
        own = self.owner
        self.divergence = check_choice(own, "divergence", self.divergence, DIVERGENCES)
        self.clip_ratio_low = check_positive(own, "clip_ratio_low", self.clip_ratio_low, allow_zero=True)
        self.clip_ratio_high = check_positive(own, "clip_ratio_high", self.clip_ratio_high, allow_zero=True)
        self.clip_ratio_c = check_positive(own, "clip_ratio_c", self.clip_ratio_c)
        self.value = check_choice(own, "value", self.value, VALUE_FORMS)


@dataclass
class CPPOSettings(DPPOSettings):
    """CPPOClip's settings (conf/clip/cppo.yaml): DPPO's, with the positional weight and the prefix budget."""

    w_min: float = 0.8  # in (0, 1]: the last token's weight; 1 turns the position weight off
    budget: str = "prefix_mean"  # prefix_mean | none
    owner: str = "CPPOClip"  # the rule named in the messages

    def __post_init__(self) -> None:
        super().__post_init__()
        own, w_min = self.owner, self.w_min
        self.w_min = check_positive(own, "w_min", w_min)
        if self.w_min > 1.0:
            raise ValueError(f"{own}: w_min must be in (0, 1] (the last token's weight; 1 turns the position "
                             f"weight off), got {w_min!r}")
        self.budget = check_choice(own, "budget", self.budget, BUDGETS)


@dataclass
class VESPOSettings:
    """VESPOClip's settings (conf/clip/vespo.yaml): the kernel's shapes for A > 0 and A < 0."""

    k_pos: float = 2.0  # >= 0
    lambda_pos: float = 3.0  # >= 0
    k_neg: float = 3.0  # >= 0
    lambda_neg: float = 2.0  # >= 0
    value: str = "surrogate"  # surrogate | verl
    length_scale: str = "none"  # none | sqrt: the kernel's input S or S sqrt(ref_length / L)
    ref_length: float = 72.0  # > 0: the length at which length_scale=sqrt leaves S as it is
    owner: str = "VESPOClip"  # the rule named in the messages

    def __post_init__(self) -> None:
        own = self.owner
        for name in ("k_pos", "lambda_pos", "k_neg", "lambda_neg"):
            setattr(self, name, check_positive(own, name, getattr(self, name), allow_zero=True))
        self.value = check_choice(own, "value", self.value, VALUE_FORMS)
        self.length_scale = check_choice(own, "length_scale", self.length_scale, LENGTH_SCALES)
        self.ref_length = check_positive(own, "ref_length", self.ref_length)


@dataclass
class CTPOSettings:
    """CTPOClip's settings (conf/clip/ctpo.yaml): the length-adjusted band on the token ratio's running product."""

    la_clip_low: float = 0.025  # > 0: the band below
    la_clip_high: float = 0.05  # > 0: the band above
    la_clip_c: Optional[float] = 0.05  # > 0: the dual clip for A < 0; null: off
    la_power: float = 0.5  # finite: 0.5 with cumprod, -0.5 with geomean
    ratio_mode: str = "cumprod"  # cumprod | geomean
    acceptance: str = "prefix"  # prefix | last
    owner: str = "CTPOClip"  # the rule named in the messages

    def __post_init__(self) -> None:
        own = self.owner
        self.la_clip_low = check_positive(own, "la_clip_low", self.la_clip_low)
        self.la_clip_high = check_positive(own, "la_clip_high", self.la_clip_high)
        self.la_clip_c = None if self.la_clip_c is None else check_positive(own, "la_clip_c", self.la_clip_c)
        p = float(self.la_power)
        if not math.isfinite(p):
            raise ValueError(f"{own}: la_power must be finite (0.5 with cumprod, -0.5 with geomean), "
                             f"got {self.la_power!r}")
        self.la_power = p
        self.ratio_mode = check_choice(own, "ratio_mode", self.ratio_mode, RATIO_MODES)
        self.acceptance = check_choice(own, "acceptance", self.acceptance, ACCEPTANCES)


# clip._target_ -> the settings class (the rule is named in messages by its class name)
SETTINGS = {
    "fspo.clipping.fspo.FSPOClip": FSPOSettings,
    "fspo.clipping.grpo.GRPOClip": RatioClipSettings,
    "fspo.clipping.rloo.RLOOClip": RLOOSettings,
    "fspo.clipping.gspo.GSPOClip": GSPOSettings,
    "fspo.clipping.cispo.CISPOClip": CISPOSettings,
    "fspo.clipping.sapo.SAPOClip": SAPOSettings,
    "fspo.clipping.gmpo.GMPOClip": GMPOSettings,
    "fspo.clipping.dppo.DPPOClip": DPPOSettings,
    "fspo.clipping.cppo.CPPOClip": CPPOSettings,
    "fspo.clipping.vespo.VESPOClip": VESPOSettings,
    "fspo.clipping.ctpo.CTPOClip": CTPOSettings,
    "fspo.clipping.luspo.LUSPOClip": GSPOSettings,
}


def settings_error(node: Mapping[str, Any], key: str = "clip") -> Optional[str]:
    """``key``'s settings (a resolved ``clip:`` mapping with its ``_target_``) checked by the rule's settings
    class: one line naming the key and the problem, or None (fine, or a rule without a settings class here)."""
    target = str(node.get("_target_", ""))
    if target not in SETTINGS:
        return None
    kwargs = {k: v for k, v in node.items() if k != "_target_"}
    try:
        SETTINGS[target](**kwargs, owner=target.rsplit(".", 1)[1])
    except TypeError:  # an argument the rule does not take: the key check names the closest one
        return None
    except ValueError as e:
        bad = next((k for k in kwargs if f" {k} " in f" {str(e).split(': ', 1)[-1]}"), None)
        value = kwargs.get(bad)
        shown = f"{key}.{bad}={f'{value:g}' if isinstance(value, float) else value}" if bad is not None else key
        return f"{shown}: {e}"
    return None
