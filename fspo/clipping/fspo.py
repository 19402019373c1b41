"""FSPO: log-space clipping of the sequence log-ratio with a sqrt(L)-scaled band (paper eqs. (3)-(6)).

Readings of the paper this file commits to:
* Band centred on the drift: S is clipped to [mu_L - c_lower sqrt(L), mu_L + c_upper sqrt(L)] (the paper's
  clip(S, -b_L, b_L) for mu_L = 0), so c(L) = 2 Phi(-z) at every L also when mu_L != 0.
* Dual clip in log space, scaled like the band: for A < 0 the loss -A exp(S) is capped at
  -A exp(mu_L + c_dual sqrt(L)), c_dual >= c_upper (Table 4's 0.03 as an unscaled bound would override the
  band beyond L = 1).
* EMA band (paper appendix): c_upper = c_lower = z sigma_t, sigma_t = (1 - alpha) sigma_{t-1} +
  alpha std_batch((S - mu_L) / sqrt(L)), sigma_0 = ``sigma0``; dual scale max(c_dual, z sigma_t).
* Calibrated bands (beyond the paper; calibration.py, quantile_band.py, affine_band.py): S clipped to
  mu_L -+ z scale(L) with scale(L) measured per length; dual bound mu_L + max(c_dual sqrt(L), z scale(L)).
* KL drift (eq. (6)): mu_L = -kl_bar L, kl_bar an EMA of the k3 estimate mean_t (r_t - 1 - log r_t); used
  with drift="kl", tracked always.
* Float safety: exp is taken only of the selected exponent, both edges capped at 20, so no inf/NaN for any
  L or |S|.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor

from fspo.clipping._common import (
    MAX_LOG_RATIO,
    prepare,
    seq_advantage,
    seq_log_ratio_per_token,
    seq_result,
    token_log_ratio,
)
from fspo.clipping.affine_band import AffineVarianceBand
from fspo.clipping.base import ClipResult, ClipRule
from fspo.clipping.calibration import CALIBRATORS as _MOMENT_CALIBRATORS
from fspo.clipping.quantile_band import QuantileBand
from fspo.clipping.settings import FSPOSettings

#: ``band`` name -> calibrator class
CALIBRATORS = {**_MOMENT_CALIBRATORS, "quantile": QuantileBand, "affine": AffineVarianceBand}

Scale = Union[float, Tensor]


class FSPOClip(ClipRule):
    """FSPO's log-space sequence clip (paper eqs. (3), (4), (5)). With S_i = sum_t m_t (logp_new - logp_old),
    lo = mu_L - c_lower sqrt(L), hi = mu_L + c_upper sqrt(L), du = mu_L + c_dual sqrt(L):

        loss_i = -min(exp(S_i) A_i, exp(clip(S_i, lo, hi)) A_i);  for A_i < 0: loss_i = min(loss_i, -A_i exp(du))

    on every token of sequence i, in the gradient form ``ratio_grad`` (base.py). Binding: upper A > 0, S > hi;
    lower A < 0, S < lo; dual A < 0, S > du. ``in_band``: lo <= S <= hi. With ``c_dual=None`` a negative-advantage
    S above 20 is ``clip_cap``. L = 0 gives loss 0. Settings: `FSPOSettings` (``band``: fixed | ema |
    `CALIBRATORS`, ``calibration`` the calibrator's keywords).
    """

    settings = ("c_upper", "c_lower", "c_dual", "band", "drift", "z", "alpha", "ratio_grad")
    level = "sequence"
    BANDS = ("fixed", "ema") + tuple(CALIBRATORS)
    DRIFTS = ("zero", "kl")

    def __init__(self, c_upper: float = FSPOSettings.c_upper, c_lower: float = FSPOSettings.c_lower,
                 c_dual: Optional[float] = FSPOSettings.c_dual, band: str = FSPOSettings.band,
                 drift: str = FSPOSettings.drift, z: float = FSPOSettings.z, alpha: float = FSPOSettings.alpha,
                 sigma0: float = FSPOSettings.sigma0, ratio_grad: str = FSPOSettings.ratio_grad,
                 calibration: Optional[Mapping[str, Any]] = None) -> None:
        super().__init__()
        s = FSPOSettings(c_upper, c_lower, c_dual, band, drift, z, alpha, sigma0, ratio_grad, owner=type(self).__name__)
        self._take(s)
        self.register_buffer("sigma_hat", torch.tensor(s.sigma0))
        self.register_buffer("kl_bar", torch.tensor(0.0))
        self.calibrator = None
        if self.band in CALIBRATORS:
            cls = CALIBRATORS[self.band]
            extra = {"z": self.z} if getattr(cls, "needs_z", False) else {}
            self.calibrator = cls(sigma0=float(sigma0), **extra, **dict(calibration or {}))

    def scales(self) -> Tuple[Scale, Scale, Optional[Scale]]:
        """(c_upper, c_lower, c_dual) in effect: the settings, or z*sigma_hat for the EMA band."""
        if self.band == "fixed":
            return self.c_upper, self.c_lower, self.c_dual
        c = self.z * self.sigma_hat
        return c, c, None if self.c_dual is None else torch.clamp(c, min=self.c_dual)

    def drift_mu(self, lengths: Tensor) -> Tensor:
        """mu_L: 0 (paper) or -kl_bar * L (eq. (6)), float32 [B]."""
        return -self.kl_bar * lengths if self.drift == "kl" else torch.zeros_like(lengths)

    def bounds(self, lengths: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """(lo, hi, du) per sequence [B]; hi and du capped at log-ratio 20."""
        mu = self.drift_mu(lengths)
        root = lengths.sqrt()
        if self.calibrator is not None:
            w = self.z * self.calibrator.scale(lengths).to(mu)
            up = lo = w
            dw = None if self.c_dual is None else torch.maximum(self.c_dual * root, w)
        else:
            c_up, c_lo, c_du = self.scales()
            up, lo = c_up * root, c_lo * root
            dw = None if c_du is None else c_du * root
        hi = (mu + up).clamp(max=MAX_LOG_RATIO)
        du = (mu + dw).clamp(max=MAX_LOG_RATIO) if dw is not None else torch.full_like(hi, MAX_LOG_RATIO)
        return mu - lo, hi, du

    def forward(self, log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor,
                response_mask: Tensor) -> ClipResult:
        p = prepare(type(self).__name__, log_prob, old_log_prob, advantages, response_mask)
        s = token_log_ratio(p).sum(-1)
        a = seq_advantage(advantages, p)
        lo, hi, du = self.bounds(p.lengths)
        sd = s.detach()
        upper = (a > 0) & (sd > hi)
        lower = (a < 0) & (sd < lo)
        dual = (a < 0) & (sd > du) if self.c_dual is not None else torch.zeros_like(upper)
        cap = (a < 0) & (sd > MAX_LOG_RATIO) & ~dual  # c_dual = null: only the float-safety cap holds
        in_band = (sd >= lo) & (sd <= hi)
        # the exponent: the sequence's log-ratio where no clip binds, the bound (no gradient) where one does
        tok = seq_log_ratio_per_token(p, sd, self.ratio_grad, s)
        bound = torch.where(upper, hi, torch.where(lower, lo, torch.where(dual, du, MAX_LOG_RATIO)))
        e = torch.where((upper | lower | dual | cap).unsqueeze(-1), bound.unsqueeze(-1), tok)
        e = e.clamp(max=MAX_LOG_RATIO)  # changes only A == 0 rows (loss 0) once cap is taken above
        return seq_result(-a.unsqueeze(-1) * torch.exp(e), s, upper, lower, dual, in_band, cap, p)

    @torch.no_grad()
    def observe(self, seq_log_ratio: Tensor, lengths: Tensor, token_log_ratio: Tensor,
                response_mask: Tensor) -> None:
        """EMA updates of sigma_hat (unbiased std of (S - mu_L) / sqrt(L) over L > 0, needs >= 2 sequences) and
        kl_bar (masked token mean of k3 = exp(d) - 1 - d, needs a token), from sums all-reduced across ranks."""
        length = lengths.to(torch.float64)
        valid = length > 0
        zres = (seq_log_ratio.to(torch.float64) - self.drift_mu(length).to(torch.float64)) \
            / length.clamp(min=1.0).sqrt()
        zres = torch.where(valid, zres, 0.0)
        m = response_mask.bool()
        d = token_log_ratio.to(torch.float64).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
        k3 = torch.where(m, torch.expm1(d) - d, 0.0)
        stats = torch.stack([valid.sum().to(torch.float64), zres.sum(), zres.square().sum(),
                             k3.sum(), m.sum().to(torch.float64)])
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(stats)
        n, sz, szz, ksum, ntok = stats.unbind()
        var = ((szz - sz * sz / n.clamp(min=1.0)) / (n - 1.0).clamp(min=1.0)).clamp(min=0.0)
        a = self.alpha
        sigma = (1 - a) * self.sigma_hat.double() + a * var.sqrt()
        kl = (1 - a) * self.kl_bar.double() + a * ksum / ntok.clamp(min=1.0)
        self.sigma_hat.copy_(torch.where(n >= 2, sigma, self.sigma_hat.double()))
        self.kl_bar.copy_(torch.where(ntok > 0, kl, self.kl_bar.double()))
        if self.calibrator is not None:  # the drift of this batch, as for sigma_hat above
            self.calibrator.observe(seq_log_ratio, lengths, self.drift_mu(length).to(seq_log_ratio))

    def theory_clip_fraction(self, lengths, sigma: float):
        """c(L) = P(S - mu_L > c_upper sqrt L) + P(S - mu_L < -c_lower sqrt L) with the scales in effect; 2 Phi(-z)
        for the calibrated bands."""
        from fspo.clipping.theory import c_fspo, c_fspo_symmetric
        if self.calibrator is not None:  # the band tracks std(S_L) itself: 2 Phi(-z) at every L
            return c_fspo_symmetric(lengths, self.z)
        c_up, c_lo, _ = self.scales()
        return c_fspo(lengths, sigma, float(c_up), float(c_lo))

    def extra_metrics(self) -> Dict[str, float]:
        """clip/sigma_hat, clip/kl_bar, and the scales in effect (EMA) or the calibrator's metrics."""
        c_up, c_lo, c_du = self.scales()
        out = {"clip/sigma_hat": float(self.sigma_hat), "clip/kl_bar": float(self.kl_bar)}
        if self.calibrator is not None:
            out.update(self.calibrator.metrics())
            return out
        if self.band == "fixed":
            return out
        out.update({"clip/c_upper": float(c_up), "clip/c_lower": float(c_lo)})
        if c_du is not None:
            out["clip/c_dual"] = float(c_du)
        return out
