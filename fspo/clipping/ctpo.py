"""CTPO (arXiv 2605.07331, github horizon-llm/CTPO): cumulative-prefix token ratios with a log-space clip that
widens with the position: each prefix C_t is clipped to [-low t^p, high t^p] (p = 1/2), and token t loses its
gradient alone. At t = L it is FSPO's event with c = high = low.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional

import numpy as np
import torch
from torch import Tensor

from fspo.clipping._common import (
    MAX_LOG_RATIO,
    cap_mask,
    prepare,
    seq_result,
    token_advantage,
    token_log_ratio,
)
from fspo.clipping.base import ClipResult, ClipRule
from fspo.clipping.registry import _get, rule_loss
from fspo.clipping.settings import ACCEPTANCES, RATIO_MODES, CTPOSettings  # noqa: F401  (this rule's names)

#: CTPO's cap on the prefix log-ratio before exp
CTPO_MAX_LOG_RATIO = 10.0


class CTPOClip(ClipRule):
    """CTPO-LA, the CTPO repository's ``cum-token-cumprod-la`` (``ratio_mode="cumprod"``) or ``cum-token-geomean-la``
    (``"geomean"``). Per response token t = 1, 2, ... with d_s = clamp(d_s, -20, 20):

        C_t = sum_{s <= t} d_s (cumprod)  or  (1 / t) sum_{s <= t} d_s (geomean)
        log r_t = min(sg(C_t) + logp_t - sg(logp_t), 10);  lo_t = -low t^p, hi_t = high t^p, du_t = c t^p
        loss_t = max(-A_t r_t, -A_t exp(clip(log r_t, lo_t, hi_t)));  for A_t < 0: min(loss_t, -A_t exp(du_t))

    Settings: the repository's names and ctpo.sh's values (``la_clip_c`` None: no dual, ours; below ``la_clip_high``
    allowed, as CTPO). Masks: upper A_t > 0, C_t > hi_t; lower A_t < 0, C_t < lo_t; dual A_t < 0, r_t > exp(du_t);
    cap C_t > 10 alone. ``acceptance`` (our reading): ``prefix`` lo_t <= C_t <= hi_t per token; ``last`` the last
    prefix's decision on every token (FSPO's event for cumprod, p = 1/2, high = low).
    """

    settings = ("la_clip_low", "la_clip_high", "la_clip_c", "la_power", "ratio_mode", "acceptance")
    level = "token"

    def __init__(self, la_clip_low: float = CTPOSettings.la_clip_low, la_clip_high: float = CTPOSettings.la_clip_high,
                 la_clip_c: Optional[float] = CTPOSettings.la_clip_c, la_power: float = CTPOSettings.la_power,
                 ratio_mode: str = CTPOSettings.ratio_mode, acceptance: str = CTPOSettings.acceptance) -> None:
        super().__init__()
        self._take(CTPOSettings(la_clip_low, la_clip_high, la_clip_c, la_power, ratio_mode, acceptance,
                                owner=type(self).__name__))

    def forward(self, log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor,
                response_mask: Tensor) -> ClipResult:
        p = prepare(type(self).__name__, log_prob, old_log_prob, advantages, response_mask)
        d = token_log_ratio(p)
        pos = torch.cumsum(p.maskf, -1)  # t: 1, 2, ... on response tokens
        prefix = torch.cumsum(d.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO), -1)
        if self.ratio_mode == "geomean":
            prefix = prefix / pos.clamp(min=1.0)
        stat = torch.where(p.mask, prefix, 0.0).detach()
        lp = torch.where(p.mask, p.log_prob, 0.0)  # padding may hold -inf: keep grads finite
        log_r = (stat.detach() + lp - lp.detach()).clamp(max=CTPO_MAX_LOG_RATIO)
        scale = pos.clamp(min=1.0).pow(self.la_power) if self.la_power != 0 else torch.ones_like(pos)
        lo, hi = -self.la_clip_low * scale, self.la_clip_high * scale
        adv = token_advantage(advantages, p)
        l1 = -adv * torch.exp(log_r)
        l2 = -adv * torch.exp(torch.clamp(log_r, lo, hi))
        loss = torch.maximum(l1, l2)
        bind = l2 > l1
        neg = adv < 0
        upper, lower = bind & (adv > 0), bind & neg
        if self.la_clip_c is None:
            dual = torch.zeros_like(bind)
        else:
            l3 = -adv * torch.exp(self.la_clip_c * scale)
            dual = (loss > l3) & neg
            loss = torch.where(neg, torch.minimum(loss, l3), loss)
        m = p.mask
        if self.acceptance == "prefix":
            in_band = (stat >= lo) & (stat <= hi)
        else:  # the last prefix's decision on every token of the sequence
            last = m & (pos == p.lengths.unsqueeze(-1))
            s_l, lo_l, hi_l = ((x * last).sum(-1) for x in (stat, lo, hi))
            in_band = ((s_l >= lo_l) & (s_l <= hi_l)).unsqueeze(-1).expand_as(m)
        cap = cap_mask(stat, adv, upper | lower | dual, None, CTPO_MAX_LOG_RATIO)
        return seq_result(loss, d.sum(-1), upper, lower, dual, in_band, cap, p)

    def theory_clip_fraction(self, lengths, sigma: float):
        """With iid d_t ~ N(0, sigma^2): o(t) = Phi(-high t^p / std_t) + Phi(-low t^p / std_t), std_t = sigma sqrt(t)
        (cumprod) or sigma / sqrt(t) (geomean); c(L) = mean_{t <= L} o(t) (``prefix``) or o(L) (``last``)."""
        from scipy.special import ndtr

        from fspo.clipping.theory import _as_len
        L = np.rint(_as_len(lengths)).astype(np.int64)
        n = max(int(L.max(initial=0)), 1)
        t = np.arange(1, n + 1, dtype=np.float64)
        std = sigma * (np.sqrt(t) if self.ratio_mode == "cumprod" else 1.0 / np.sqrt(t))
        band = t ** self.la_power
        o = ndtr(-self.la_clip_high * band / std) + ndtr(-self.la_clip_low * band / std)
        per_len = np.cumsum(o) / t if self.acceptance == "prefix" else o
        return np.where(L > 0, per_len[np.maximum(L, 1) - 1], 0.0)


def _ctpo(ratio_mode: str) -> Callable[[Any], ClipRule]:
    def build(config: Any) -> ClipRule:
        kw: Dict[str, Any] = {"la_clip_low": _get(config, "la_clip_low"), "la_clip_high": _get(config, "la_clip_high"),
                              "la_clip_c": _get(config, "la_clip_c"), "la_power": _get(config, "clip_ratio_la_power")}
        return CTPOClip(**{k: v for k, v in kw.items() if v is not None}, ratio_mode=ratio_mode)
    build.__doc__ = (f"The CTPO repository's ``cum-token-{ratio_mode}-la``: `CTPOClip(ratio_mode={ratio_mode!r})`, "
                     "config ``la_clip_low``, ``la_clip_high``, ``la_clip_c``, ``clip_ratio_la_power``.")
    return build


policy_loss_ctpo = rule_loss("ctpo", "cum-token-cumprod-la")(_ctpo("cumprod"))
policy_loss_ctpo_geomean = rule_loss("cum-token-geomean-la")(_ctpo("geomean"))
