"""GMPO (arXiv 2507.20673): the geometric mean of token-clipped ratios as the sequence ratio."""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from fspo.clipping._common import (
    MAX_LOG_RATIO,
    prepare,
    seq_advantage,
    seq_result,
    token_advantage,
    token_log_ratio,
)
from fspo.clipping.base import ClipResult, ClipRule
from fspo.clipping.registry import _masked_mean, _ratio_kwargs, register_policy_loss
from fspo.clipping.settings import GMPOSettings
from fspo.losses import aggregate


class GMPOClip(ClipRule):
    """GMPO with its per-token clip, verl 0.9.1's ``geo_mean``. With sgn_t = sign(A_t) and the log band [-low, high]:
    c_t = sgn_t min(sgn_t d_t, sgn_t clip(d_t, -low, high)), G_i = (1 / L_i) sum_t m_t c_t,

        J_i = A_i exp(G_i)

    on every token as exp(sg(G_i) + c_t - sg(c_t)): gradient -A_i exp(G_i) on unclipped tokens, 0 on clipped ones.
    ``clip_ratio_low`` / ``clip_ratio_high`` are log-space. G_i capped at 20 (``clip_cap``; not in verl). Masks:
    upper A_t > 0, d_t > high; lower A_t < 0, d_t < -low; ``in_band`` -low <= d_t <= high.
    """

    settings = ("clip_ratio_low", "clip_ratio_high")
    level = "token"

    def __init__(self, clip_ratio_low: float = GMPOSettings.clip_ratio_low,
                 clip_ratio_high: float = GMPOSettings.clip_ratio_high) -> None:
        super().__init__()
        self._take(GMPOSettings(clip_ratio_low, clip_ratio_high, owner=type(self).__name__))

    def forward(self, log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor,
                response_mask: Tensor) -> ClipResult:
        p = prepare(type(self).__name__, log_prob, old_log_prob, advantages, response_mask)
        d = token_log_ratio(p)
        adv_t = token_advantage(advantages, p)
        sgn = torch.sign(adv_t)
        d_clip = torch.clamp(d, -self.clip_ratio_low, self.clip_ratio_high)
        c = sgn * torch.min(sgn * d, sgn * d_clip)  # verl's expression, so autograd matches it exactly
        g = (c * p.maskf).sum(-1).detach() / p.lengths.clamp(min=1.0)
        a = seq_advantage(advantages, p)
        cap = (g > MAX_LOG_RATIO) & (a != 0)
        e = torch.where(cap.unsqueeze(-1), MAX_LOG_RATIO, g.clamp(max=MAX_LOG_RATIO).unsqueeze(-1) + c - c.detach())
        dd = d.detach()
        in_band = (dd >= -self.clip_ratio_low) & (dd <= self.clip_ratio_high)
        return seq_result(-a.unsqueeze(-1) * torch.exp(e), dd.sum(-1), (sgn > 0) & (dd > self.clip_ratio_high),
                          (sgn < 0) & (dd < -self.clip_ratio_low), torch.zeros_like(p.mask), in_band, cap, p)


@register_policy_loss("geo_mean")
@register_policy_loss("gmpo")
def policy_loss_gmpo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode: str = "token-mean",
                     config: Any = None, rollout_is_weights: Optional[Tensor] = None):
    """verl's ``geo_mean``: `GMPOClip`, the mean of J_i over all B rows (``loss_agg_mode`` and ``global_batch_info``
    ignored, as verl). ``rollout_is_weights`` [B, T] weigh J_i by their geometric mean over the sequence's tokens,
    exp(sum_t m_t log(w_t + 1e-10) / (sum_t m_t + 1e-8)), as verl. Clip fractions: token share out of the band
    with A_t > 0 / A_t < 0; ``actor/ppo_kl`` unclamped."""
    rule = GMPOClip(**_ratio_kwargs(config, GMPOClip))
    res = rule(log_prob, old_log_prob, advantages, response_mask)
    m = response_mask.bool().float()
    token_loss = res.token_loss
    if rollout_is_weights is not None:
        mask = response_mask.to(token_loss.dtype)
        log_w = (torch.log(rollout_is_weights.to(token_loss.dtype) + 1e-10) * mask).sum(-1)
        token_loss = token_loss * torch.exp(log_w / (mask.sum(-1) + 1e-8))[:, None]
    loss = aggregate(token_loss, response_mask, "seq-mean-token-mean", total_seqs=m.shape[0]).loss
    adv = advantages if advantages.dim() == 2 else advantages[:, None].expand_as(m)
    out = ~res.in_band
    d = torch.where(m.bool(), log_prob.detach().float() - old_log_prob.float(), 0.0)
    return loss, {"actor/pg_clipfrac": _masked_mean(out & (adv > 0), m),
                  "actor/ppo_kl": _masked_mean(-d, m),
                  "actor/pg_clipfrac_lower": _masked_mean(out & (adv < 0), m)}
