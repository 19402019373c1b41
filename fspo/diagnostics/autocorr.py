"""Autocorrelation of the per-token log-ratios d_t along a response: why std(S_L) does or does not grow like
sqrt(L) (paper section "Distribution of Sequence-Level Log Ratio"). For stationary d_t with variance v and
lag-k autocorrelation rho_k,

    Var(S_L) = L v (1 + 2 sum_{k=1}^{L-1} (1 - k/L) rho_k)

so std(S_L) ~ sqrt(L) when tau = 1 + 2 sum_k rho_k converges well below L. Sum-reduced states per lag k
(0 included): pairs n_k, sum d_t d_{t+k}, sum d_t, sum d_{t+k}; cov_k with each lag's own pair means,
rho_k = cov_k / cov_0. Keys: ``logratio/acf/lag_<k>``, ``logratio/acf_tau`` (two-sided trapezoid area of rho
over the logged lags), ``logratio/tok_std`` and ``logratio/tok_std/<position bin>`` (a flat profile:
comparable terms). Keys with no pairs are omitted.
"""
from __future__ import annotations

from typing import Dict, Sequence

import torch
from torch import Tensor

from fspo.diagnostics._base import DiagnosticMetric
from fspo.diagnostics.bins import LengthBins, check_finite

DEFAULT_LAGS = (1, 2, 4, 8, 16, 32, 64, 128)


class TokenLogRatioACF(DiagnosticMetric):
    """``update(token_log_ratio [B, T], response_mask [B, T])``; ``positions``: `LengthBins` over the token's
    0-based position."""

    def __init__(self, positions: LengthBins, lags: Sequence[int] = DEFAULT_LAGS, **kwargs) -> None:
        super().__init__(**kwargs)
        lags = sorted({int(k) for k in lags} | {0})
        if lags[0] < 0:
            raise ValueError(f"TokenLogRatioACF: lags must be >= 0, got {lags}")
        self.lags, self.positions = lags, positions
        K, P = len(lags), positions.n_bins
        for name in ("n", "prod", "left", "right"):
            self.add_state(name, torch.zeros(K, dtype=torch.float64), dist_reduce_fx="sum")
        for name in ("pos_n", "pos_s", "pos_s2"):
            self.add_state(name, torch.zeros(P, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, token_log_ratio: Tensor, response_mask: Tensor) -> None:
        d = torch.as_tensor(token_log_ratio).detach().to(self.n.device).double()
        m = torch.as_tensor(response_mask).to(d.device).bool()
        if d.shape != m.shape or d.dim() != 2:
            raise ValueError(f"token_log_ratio {tuple(d.shape)} and response_mask {tuple(m.shape)} must both be [B, T]")
        d = torch.where(m, d, torch.zeros_like(d))
        check_finite("token_log_ratio", d, "check log-probs upstream")
        md = m.double()
        T = d.shape[1]
        for i, k in enumerate(self.lags):
            if k >= T:
                continue
            a, b = d[:, :T - k], d[:, k:]
            pair = md[:, :T - k] * md[:, k:]
            self.n[i] += pair.sum()
            self.prod[i] += (a * b * pair).sum()
            self.left[i] += (a * pair).sum()
            self.right[i] += (b * pair).sum()
        pos = torch.arange(T, device=d.device).expand_as(d)[m]
        idx = self.positions.index(pos + 1)  # bins hold lengths >= 1: position t is the (t+1)-th token
        keep = idx >= 0
        v = d[m][keep]
        idx = idx[keep]
        self.pos_n.index_add_(0, idx, torch.ones_like(v))
        self.pos_s.index_add_(0, idx, v)
        self.pos_s2.index_add_(0, idx, v * v)

    def compute(self) -> Dict[str, float]:
        out: Dict[str, float] = {}
        n = self.n.clamp_min(1.0)
        cov = self.prod / n - (self.left / n) * (self.right / n)
        if float(self.n[0]) < 2 or float(cov[0]) <= 0:
            return out
        out["logratio/tok_std"] = float(cov[0].sqrt())
        rho = cov / cov[0]
        ks, rs = [0], [1.0]
        for i, k in enumerate(self.lags):
            if k > 0 and float(self.n[i]) > 0:
                out[f"logratio/acf/lag_{k:04d}"] = float(rho[i])
                ks.append(k)
                rs.append(float(rho[i]))
        if len(ks) > 1:  # the two-sided area of rho over |k| <= max lag, trapezoid between the lags logged
            out["logratio/acf_tau"] = 2 * sum((ks[j + 1] - ks[j]) * (rs[j + 1] + rs[j]) / 2 for j in range(len(ks) - 1))
        labels = self.positions.labels
        for b in torch.nonzero(self.pos_n > 1).flatten().tolist():
            nb = float(self.pos_n[b])
            var = (float(self.pos_s2[b]) - float(self.pos_s[b]) ** 2 / nb) / (nb - 1)
            out[f"logratio/tok_std/{labels[b].replace('len_', 'pos_')}"] = max(var, 0.0) ** 0.5
        return out
