"""Statistics of the sequence log-ratio S_L (paper section "Distribution of Sequence-Level Log Ratio").

Exact part (sum-reduced per bin b: n_b, sum S, S^2, S/L, S^2/L, 1/L, L). With mu_b = sum_b S / n_b:

    sigma_hat^2 = (1/N) sum_i (S_i - mu_b(i))^2 / L_i
                = (1/N) sum_b [sum S^2/L - 2 mu_b sum S/L + mu_b^2 sum 1/L]

and ``sigma_hat_unbiased`` divides by sum_b (n_b - 2 + (sum L)(sum 1/L) / n_b^2), its expectation for
S_i ~ N(mu_b, sigma^2 L_i). Per bin: mean and sample std (n_b >= 2); ``std_exponent`` gamma, ``std_prefactor``,
``std_exponent_r2``, ``std_exponent_bins`` from the log-log fit of std_b on mean L_b (theory 0.5).

Sampled part: a reservoir of ``reservoir_size`` (S, L) pairs per rank (Algorithm R, the draw for the n-th
sequence a hash of (seed, n), so k updates equal one on their concatenation; ranks concatenated). Q-Q of
Z = (S - mu_b) / (sqrt(L) sigma_hat) against Blom quantiles: ``qq_slope``, ``qq_intercept``, ``qq_r2``;
``qq_r2_per_bin`` standardises by each bin's own std (shape apart from the sqrt(L) law).
Rows with L = 0 are ignored; keys with an empty denominator are omitted.
"""
from __future__ import annotations

from typing import Dict, Optional

import numpy as np
import torch
from torch import Tensor

from fspo.diagnostics._base import DiagnosticMetric
from fspo.diagnostics.bins import LengthBins, check_finite, check_lengths

_M32 = 0xFFFFFFFF
_SUMS = ("s_sum", "s2_sum", "s_over_l", "s2_over_l", "inv_l", "len_sum")


def _mul32(x: Tensor, c: int) -> Tensor:
    """(x * c) mod 2^32 for 0 <= x < 2^32 without int64 overflow (split into 16-bit halves)."""
    return ((x & 0xFFFF) * c + ((((x >> 16) * c) & 0xFFFF) << 16)) & _M32


def _hash_uniform(n: Tensor, seed: int) -> Tensor:
    """Deterministic u in [0, 1) for each int64 index n (lowbias32 hash of (seed, n)), float64."""
    x = (n & _M32) ^ ((n >> 32) * 0x9E3779B9 & _M32) ^ ((seed * 0x85EBCA6B) & _M32)
    for c in (0x7FEB352D, 0x846CA68B):
        x = x ^ (x >> 16)
        x = _mul32(x, c)
    x = x ^ (x >> 16)
    return x.double() / 4294967296.0


class LogRatioStats(DiagnosticMetric):
    """``update(seq_log_ratio [B], lengths [B])`` then ``compute()`` (module docstring); not ``forward``."""

    def __init__(self, bins: LengthBins, reservoir_size: int = 4096, seed: int = 0, **kwargs) -> None:
        super().__init__(**kwargs)
        if not isinstance(bins, LengthBins):
            raise ValueError(f"LogRatioStats: bins must be a LengthBins, got {type(bins).__name__}")
        if not isinstance(reservoir_size, int) or reservoir_size < 0:
            raise ValueError(f"LogRatioStats: reservoir_size must be an int >= 0, got {reservoir_size!r}")
        self.bins, self.reservoir_size, self.seed = bins, reservoir_size, int(seed)
        self.last_per_bin: Optional[Dict[str, np.ndarray]] = None
        self.last_z: Optional[np.ndarray] = None
        nb = bins.n_bins
        self.add_state("count", torch.zeros(nb, dtype=torch.long), dist_reduce_fx="sum")
        for name in _SUMS:
            self.add_state(name, torch.zeros(nb, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("n_seen", torch.zeros((), dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("res_s", torch.zeros(reservoir_size, dtype=torch.float64), dist_reduce_fx="cat")
        self.add_state("res_len", torch.zeros(reservoir_size, dtype=torch.long), dist_reduce_fx="cat")

    def forward(self, *args, **kwargs):  # noqa: D401
        """Not supported: merging batch and global states would concatenate reservoirs."""
        raise NotImplementedError("LogRatioStats: call update() then compute(), not forward()")

    def update(self, seq_log_ratio: Tensor, lengths: Tensor) -> None:
        """Add one (micro-)batch of S_i [B] and L_i [B]; ValueError on NaN/inf."""
        s = torch.as_tensor(seq_log_ratio).to(self.count.device)
        if s.dim() != 1:
            raise ValueError(f"seq_log_ratio must have shape [B], got {tuple(s.shape)}")
        check_finite("seq_log_ratio", s, "check log-probs upstream")
        lengths = check_lengths(lengths).to(s.device)
        if lengths.shape != s.shape:
            raise ValueError(f"lengths shape {tuple(lengths.shape)} != seq_log_ratio shape {tuple(s.shape)}")
        idx = self.bins.index(lengths)
        keep = idx >= 0
        idx, s, L = idx[keep], s[keep].double(), lengths[keep]
        if idx.numel() == 0:
            return
        Ld = L.double()
        self.count.index_add_(0, idx, torch.ones_like(idx))
        for name, v in zip(_SUMS, (s, s * s, s / Ld, s * s / Ld, 1.0 / Ld, Ld)):
            getattr(self, name).index_add_(0, idx, v)
        self._reservoir_add(s, L)

    def _reservoir_add(self, s: Tensor, L: Tensor) -> None:
        """Algorithm R, vectorised: item n goes to slot n (n < K) or slot floor(u_n (n+1)) if < K."""
        K, B = self.reservoir_size, s.numel()
        n0 = int(self.n_seen)
        self.n_seen += B
        if K == 0:
            return
        n = torch.arange(n0, n0 + B, dtype=torch.long, device=s.device)
        j = torch.floor(_hash_uniform(n, self.seed) * (n + 1).double()).long()
        slot = torch.where(n < K, n, j)
        acc = slot < K
        n, slot, s, L = n[acc], slot[acc], s[acc], L[acc]
        if n.numel() == 0:
            return
        # several items of this batch may hit one slot: the last one (largest n) wins, as in sequence
        winner = torch.full((K,), -1, dtype=torch.long, device=s.device)
        winner.scatter_reduce_(0, slot, n, reduce="amax")
        last = winner[slot] == n
        self.res_s[slot[last]] = s[last].to(self.res_s)
        self.res_len[slot[last]] = L[last]

    def compute(self) -> Dict[str, float]:
        """``logratio/*`` floats (module docstring)."""
        out: Dict[str, float] = {}
        n = self.count.double()
        has = n > 0
        nz = n.clamp_min(1.0)
        mu = torch.where(has, self.s_sum / nz, torch.zeros_like(n))
        var = torch.where(n > 1, (self.s2_sum - n * mu * mu).clamp_min(0.0) / (n - 1).clamp_min(1.0),
                          torch.zeros_like(n))
        std = var.sqrt()
        mean_len = torch.where(has, self.len_sum / nz, torch.zeros_like(n))
        labels = self.bins.labels
        for b in torch.nonzero(has).flatten().tolist():
            out[f"logratio/mean/{labels[b]}"] = float(mu[b])
            if n[b] > 1:
                out[f"logratio/std/{labels[b]}"] = float(std[b])
        N = float(n.sum())
        sigma = 0.0
        if N > 0:
            ssq = (self.s2_over_l - 2 * mu * self.s_over_l + mu * mu * self.inv_l).clamp_min(0.0)
            ssq = torch.where(has, ssq, torch.zeros_like(ssq))
            sigma = float((ssq.sum() / N).sqrt())
            out["logratio/sigma_hat"] = sigma
            dof = torch.where(has, n - 2 + self.len_sum * self.inv_l / (nz * nz), torch.zeros_like(n)).sum()
            if dof > 1e-9:
                out["logratio/sigma_hat_unbiased"] = float((ssq.sum() / dof).sqrt())
            out["logratio/n"] = N
        fit = (n > 1) & (std > 0)
        if int(fit.sum()) >= 2:
            out.update(_power_fit(mean_len[fit], std[fit]))
        self.last_z = None
        valid = self.res_len.reshape(-1) > 0
        if sigma > 0 and int(valid.sum()) >= 3:
            rs, rl = self.res_s.reshape(-1)[valid], self.res_len.reshape(-1)[valid]
            z = (rs - mu[self.bins.index(rl)]) / (rl.double().sqrt() * sigma)
            out.update(_qq_fit(z))
            self.last_z = z.sort().values.cpu().numpy()
            sb = std[self.bins.index(rl)]  # the law-free reading: each bin standardised by its own std
            ok = sb > 0
            if int(ok.sum()) >= 3:
                zb = (rs[ok] - mu[self.bins.index(rl[ok])]) / sb[ok]
                out["logratio/qq_r2_per_bin"] = _qq_fit(zb)["logratio/qq_r2"]
        self.last_per_bin = {"count": n.cpu().numpy(), "mean_len": mean_len.cpu().numpy(),
                             "mean": mu.cpu().numpy(), "std": std.cpu().numpy()}
        return out

    def reset(self) -> None:
        """Zero every state and drop the cached arrays."""
        super().reset()
        self.last_per_bin, self.last_z = None, None


def _power_fit(length: Tensor, std: Tensor) -> Dict[str, float]:
    """Least squares of log std_b = log c + gamma log L_b: gamma, c, R^2, the bin count."""
    x, y = length.double().log(), std.double().log()
    xc, yc = x - x.mean(), y - y.mean()
    vx, vy = (xc * xc).sum(), (yc * yc).sum()
    out = {"logratio/std_exponent_bins": float(x.numel())}
    if vx > 0:
        gamma = (xc * yc).sum() / vx
        out["logratio/std_exponent"] = float(gamma)
        out["logratio/std_prefactor"] = float((y.mean() - gamma * x.mean()).exp())
        out["logratio/std_exponent_r2"] = float(gamma * gamma * vx / vy) if vy > 0 else 1.0
    return out


def normal_quantiles(n: int, dtype=torch.float64, device=None) -> Tensor:
    """Blom plotting positions ``Phi^{-1}((i - 3/8) / (n + 1/4))``, i = 1..n."""
    i = torch.arange(1, n + 1, dtype=dtype, device=device)
    return torch.special.ndtri((i - 0.375) / (n + 0.25))


def _qq_fit(z: Tensor) -> Dict[str, float]:
    """Least-squares line of sorted z on normal quantiles: slope, intercept, R^2 = corr^2, n."""
    zs = z.double().sort().values
    q = normal_quantiles(zs.numel(), device=zs.device)
    qc, zc = q - q.mean(), zs - zs.mean()
    sqq, szz, sqz = (qc * qc).sum(), (zc * zc).sum(), (qc * zc).sum()
    slope = sqz / sqq
    r2 = (sqz * sqz / (sqq * szz)) if szz > 0 else torch.zeros((), dtype=zs.dtype)
    return {"logratio/qq_slope": float(slope), "logratio/qq_intercept": float(zs.mean() - slope * q.mean()),
            "logratio/qq_r2": float(r2), "logratio/qq_n": float(zs.numel())}
