"""FSPO: log-space clipping of the sequence log-ratio with a sqrt(L)-scaled band (paper section Method).

Owns: `FSPOClip` - the band, the log-space dual clip, the running sigma_hat / KL estimates (buffers,
so they are checkpointed) and their update in `observe`. Leaves out: aggregation over tokens and
sequences (fspo/losses.py) and clip-fraction-by-length diagnostics.

Readings of the paper that this file commits to:

* Band centred on the drift. The paper writes clip(S, -b_L, b_L) with b_L = mu_L + z sigma sqrt(L)
  and sets mu_L = 0. We clip S to [lo_L, hi_L] = [mu_L - c_lower sqrt(L), mu_L + c_upper sqrt(L)].
  For mu_L = 0 this is exactly the paper's band; for mu_L != 0 it keeps the band centred where the
  Gaussian S_L ~ N(mu_L, sigma^2 L) is centred, so the clip probability stays
  c(L) = P(|S - mu_L| > z sigma sqrt(L)) = 2 Phi(-z) for every L (a band [-b, b] with b = mu + ...
  would not be symmetric about the mean and its clip fraction would drift with L).
* Dual clip in log space. Table 4's c_dual = 0.03 is read as a log-space bound that scales like the
  band: for A < 0 the loss -A exp(S) is capped at -A exp(mu_L + c_dual sqrt(L)). We require
  c_dual >= c_upper so the dual bound never sits inside the band (with c_dual = c_upper, as in the
  paper, a negative-advantage sequence gets gradient only while S is inside the band). A constant
  (unscaled) log bound of 0.03 would be tighter than the band itself beyond L = 1 and override it.
* EMA band (paper appendix, not shipped there): c_upper = c_lower = z sigma_t, with
  sigma_t = (1 - alpha) sigma_{t-1} + alpha std_batch((S - mu_L) / sqrt(L)) over sequences with L > 0,
  sigma_0 = 0.03; the dual scale is max(c_dual, z sigma_t) so it never falls inside the band.
  sigma_hat is tracked in both modes (a diagnostic in "fixed" mode).
* Calibrated bands (beyond the paper; calibration.py, quantile_band.py): ``band="quantile"``
  sets the half-width to the observed erf(z / sqrt 2) quantile of |S_L - mu_L| per length bin (exact
  2 Phi(-z) out of band for any law of S_L); ``band="power"`` fits
  std(S_L - mu_L) = sigma L^gamma from running per-length-bin moments, ``band="per_bin"`` uses the
  running per-bin std interpolated in log L; both clip S to mu_L -+ z scale(L), so the clip
  probability is 2 Phi(-z) at every L when S_L is Gaussian whatever its law in L (the paper's band
  assumes gamma = 1/2). The dual bound is mu_L + max(c_dual sqrt(L), z scale(L)).
* KL drift (paper eq. mu_kl): mu_L = -kl_bar L, kl_bar an EMA of the per-token k3 estimate of
  KL(pi_old || pi_new): mean_t (r_t - 1 - log r_t), r_t = exp(logp_new - logp_old). Tracked in both
  drift modes; used in the band only with drift="kl".
* Float safety. exp is only ever taken of the selected exponent, which is <= max(hi_L, dual_L); both
  edges are capped at log-ratio 20 (ratio 4.9e8; the paper's band at L = 32,768 is 5.43), so no
  inf/NaN arises for any L or |S|, and where no clip binds the gradient is exactly -A exp(S) dS.
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

#: ``band`` name -> calibrator class: the moment bands (calibration.py) and the quantile band
CALIBRATORS = {**_MOMENT_CALIBRATORS, "quantile": QuantileBand, "affine": AffineVarianceBand}

Scale = Union[float, Tensor]


class FSPOClip(ClipRule):
    """FSPO's log-space sequence clip (paper eqs. obj-fspo, Si, band).

    With S_i = sum_t m_t (logp_new - logp_old) in float32, L_i = sum_t m_t, mu_L the drift,
    lo = mu_L - c_lower sqrt(L), hi = mu_L + c_upper sqrt(L), du = mu_L + c_dual sqrt(L):

        J_i   = min(exp(S_i) A_i, exp(clip(S_i, lo, hi)) A_i)
        loss_i = -J_i, and for A_i < 0: loss_i = min(loss_i, -A_i exp(du))       (log-space dual clip)

    on every token of sequence i. ``ratio_grad="per_token"`` (default; verl's form of a sequence
    ratio): the exponent on token t is sg(S_i) + logp_t - sg(logp_t) where no clip binds, so
    d token_loss[i, t] / d logp_{i,t} = -A_i exp(S_i) and "token-mean" gives every token of every
    unclipped sequence -A_i exp(S_i) / sum L: the gradient of paper eq. obj-fspo (A_i exp(S_i) / G
    per token, the same whatever L_i) up to the mini-batch constant G / sum L. Clipped sequences
    stay in the denominator with zero gradient. ``ratio_grad="length_weighted"``: the exponent is
    S_i itself (full gradient through S on each of the L_i tokens), so under token-mean sequence i
    pulls with L_i times the paper's weight - the form this project used before; for comparison.
    Binding: upper = A > 0 and S > hi; lower = A < 0 and S < lo; dual = A < 0 and S > du (not
    lower). Acceptance (``in_band``, the paper's event, any sign of A): lo <= S <= hi. With
    ``c_dual=None`` a negative-advantage S above the float-safety cap 20 is ``clip_cap``, not dual.
    L = 0 gives band 0 and loss 0. Settings: ``c_upper``, ``c_lower``, ``c_dual`` (> 0, log space
    per sqrt(token), paper 0.03 each, ``c_dual`` >= ``c_upper`` or None to disable), ``band``
    "fixed" | "ema" | "power" | "per_bin" | "quantile" | "affine" (``calibration``: keyword settings of the calibrator,
    e.g. alpha, min_count, bins_per_octave; calibration.py), ``drift`` "zero" | "kl", ``z`` > 0 and
    ``alpha`` in (0, 1] (EMA band and running estimates), ``sigma0`` > 0 (EMA warm start), ``ratio_grad`` "per_token" |
    "length_weighted".
    """

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
        self.ratio_grad, self.c_upper, self.c_lower, self.c_dual = s.ratio_grad, s.c_upper, s.c_lower, s.c_dual
        self.band, self.drift, self.z, self.alpha = s.band, s.drift, s.z, s.alpha
        self.register_buffer("sigma_hat", torch.tensor(s.sigma0))
        self.register_buffer("kl_bar", torch.tensor(0.0))
        # band=power|per_bin: the calibrator (its moments are buffers, so they are checkpointed)
        self.calibrator = None
        if self.band in CALIBRATORS:
            cls = CALIBRATORS[self.band]
            extra = {"z": self.z} if getattr(cls, "needs_z", False) else {}
            self.calibrator = cls(sigma0=float(sigma0), **extra, **dict(calibration or {}))

    # --- band -------------------------------------------------------------------------------
    def scales(self) -> Tuple[Scale, Scale, Optional[Scale]]:
        """(c_upper, c_lower, c_dual) in effect: the settings, or z*sigma_hat for the EMA band."""
        if self.band == "fixed":
            return self.c_upper, self.c_lower, self.c_dual
        c = self.z * self.sigma_hat
        return c, c, None if self.c_dual is None else torch.clamp(c, min=self.c_dual)

    def drift_mu(self, lengths: Tensor) -> Tensor:
        """mu_L: 0 (paper) or -kl_bar * L (eq. mu_kl), float32 [B]."""
        return -self.kl_bar * lengths if self.drift == "kl" else torch.zeros_like(lengths)

    def bounds(self, lengths: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        """(lo, hi, du) per sequence [B]; hi and du capped at log-ratio 20 (float safety)."""
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

    # --- loss -------------------------------------------------------------------------------
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
        # per-token exponent: the sequence's log-ratio (its gradient form set by ratio_grad) where no
        # clip binds, the bound (no gradient) where one does
        tok = seq_log_ratio_per_token(p, sd, self.ratio_grad, s)
        bound = torch.where(upper, hi, torch.where(lower, lo, torch.where(dual, du, MAX_LOG_RATIO)))
        e = torch.where((upper | lower | dual | cap).unsqueeze(-1), bound.unsqueeze(-1), tok)
        e = e.clamp(max=MAX_LOG_RATIO)  # changes only A == 0 rows (loss 0) once cap is taken above
        return seq_result(-a.unsqueeze(-1) * torch.exp(e), s, upper, lower, dual, in_band, cap, p)

    # --- running estimates ------------------------------------------------------------------
    @torch.no_grad()
    def observe(self, seq_log_ratio: Tensor, lengths: Tensor, token_log_ratio: Tensor,
                response_mask: Tensor) -> None:
        """EMA updates of sigma_hat and kl_bar from one mini-batch (call on every rank).

        sigma: std (unbiased) of (S - mu_L) / sqrt(L) over sequences with L > 0, mu_L the drift in
        effect for this batch; kl: masked token mean of k3 = exp(d) - 1 - d (``token_log_ratio`` and
        ``response_mask`` may have any matching shape, e.g. [B, T] or the 1-D concatenation of the
        response tokens of all micro-batches). Both are computed from
        count / sum / sum-of-squares, all-reduced when torch.distributed is initialised, so every rank
        applies the same update. A batch with < 2 sequences leaves sigma_hat unchanged; one with no
        tokens leaves kl_bar unchanged.
        """
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
        """c(L) = P(S - mu_L > c_upper sqrt L) + P(S - mu_L < -c_lower sqrt L), S ~ N(mu_L, sigma^2 L),
        with the scales in effect; 2 Phi(-z) when c = z sigma, flat in L. (The band is centred on
        the drift, so the data's drift is assumed to be the band's.)"""
        from fspo.clipping.theory import c_fspo, c_fspo_symmetric
        if self.calibrator is not None:  # the band tracks std(S_L) itself: 2 Phi(-z) at every L
            return c_fspo_symmetric(lengths, self.z)
        c_up, c_lo, _ = self.scales()
        return c_fspo(lengths, sigma, float(c_up), float(c_lo))

    def extra_metrics(self) -> Dict[str, float]:
        """Scalars to log: clip/sigma_hat, clip/kl_bar and, for the EMA band, the scales in effect
        (clip/c_*). The fixed band's scales are the settings: params (``clip/c_upper`` ...), not metrics."""
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

    def extra_repr(self) -> str:
        return (f"c_upper={self.c_upper}, c_lower={self.c_lower}, c_dual={self.c_dual}, band={self.band}"
                f", drift={self.drift}, z={self.z}, alpha={self.alpha}, ratio_grad={self.ratio_grad}")
