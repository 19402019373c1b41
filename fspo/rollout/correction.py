"""Train-inference mismatch correction: detached per-token weights [B, T] for the gap between the engine's
sampling law and the trainer's old policy, multiplied into each token's loss term before aggregation (as verl's
``rollout_is_weights``; masked tokens stay in the denominators). Per token t of sequence i (L_i tokens):

    d_t = log pi_old_trainer(y_t) - log pi_engine(y_t),     S_i = sum_t d_t

    none           weight 1 (the default; nothing computed)
    token_tis      w_t = clip(exp(d_t), lo, cap)             token truncated IS (verl token, TRL token_truncate)
    seq_is         w_i = clip(exp(S_i), lo, cap) per token   sequence truncated IS (verl sequence, TRL
                                                             sequence_truncate)
    seq_mask       w_i = 1{ lo <= exp(S'_i) <= cap }         sequence rejection (verl rollout_rs=seq_sum_k1)
    seq_masked_is  w_i = exp(S_i) 1{ lo <= exp(S_i) <= cap } masked sequence IS (TRL sequence_mask, IcePop)
    seq_fair_mask  w_i = 1{ |S_i - m L_i| <= h(L_i) }         the length-fair mask
    seq_fair_tis   w_i = exp(min(S_i, m L_i + h(L_i)))       the length-fair truncated IS

``lo`` is ``cap_min`` (null: 1/cap for seq_mask, else no floor). S'_i sums d_t clamped to +-20 per token; every
exp() clamps its exponent to [-20, 20] (verl's). The fair band: h(L) = z s sqrt(L) (``band: sqrt``; m = sum S /
sum L, s^2 = mean over sequences of (S - m L)^2 / L, over all ranks) or the per-bin erf(z / sqrt 2) quantile of
|S_L - m L| (``band: quantile``). ``off_policy_mask`` (off_policy_mask.py) applies on top of any mode. A mode
needs the trainer's recomputed old log-probs at temperature 1. Rationale and metrics: docs/mismatch.md.
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch
from torch import Tensor

from fspo.clipping.quantile_band import QuantileBand
from fspo.diagnostics._base import DiagnosticMetric
from fspo.diagnostics.bins import LengthBins
from fspo.diagnostics.lre import length_fairness
from fspo.rollout.off_policy_mask import OffPolicyMask
from fspo.rollout.settings import CorrectionSettings as SETTINGS  # its defaults
from fspo.runtime.launch.distributed import reduce_sum

MODES = ("none", "token_tis", "seq_is", "seq_mask", "seq_masked_is", "seq_fair_mask", "seq_fair_tis")
BANDS = ("sqrt", "quantile")
_MAX_LOG = 20.0  # exp() stays finite: log-weights are clamped to +-20 before exponentiating


def mismatch(old: Tensor, engine: Tensor, mask: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """d [B, T] = (old - engine) on the mask (0 elsewhere, float64), S [B] = sum_t d_t, L [B] (float64)."""
    m = mask.to(torch.float64)
    d = (old.to(torch.float64) - engine.to(torch.float64)) * m
    return d, d.sum(-1), m.sum(-1)


class CorrectionMetrics(DiagnosticMetric):
    """Per-length-bin sums of the mismatch and of the correction."""

    def __init__(self, bins: LengthBins, lre_min_len: float = 0) -> None:
        super().__init__()
        self.bins = bins
        self.lre_min_len = float(lre_min_len or 0)
        k = bins.n_bins
        for name in ("n_seq", "s_sum", "s_sq", "corrected", "abs_adv"):
            self.add_state(name, torch.zeros(k, dtype=torch.float64), dist_reduce_fx="sum")
        for name in ("tok_n", "tok_sum", "tok_sq"):
            self.add_state(name, torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, d: Tensor, seq: Tensor, lengths: Tensor, corrected: Tensor, mask: Tensor,
               advantages: Optional[Tensor] = None) -> None:
        idx = self.bins.index(lengths.long()).to(self.n_seq.device)
        ok = idx >= 0
        i = idx[ok]
        dev = self.n_seq.device
        seq, corrected = seq.to(dev, torch.float64)[ok], corrected.to(dev, torch.float64)[ok]
        self.n_seq.index_add_(0, i, torch.ones_like(seq))
        self.s_sum.index_add_(0, i, seq)
        self.s_sq.index_add_(0, i, seq.square())
        self.corrected.index_add_(0, i, corrected)
        if advantages is not None:
            self.abs_adv.index_add_(0, i, advantages.to(dev, torch.float64)[ok].abs())
        m = mask.bool().to(dev)
        dt = d.to(dev, torch.float64)[m]
        self.tok_n += float(dt.numel())
        self.tok_sum += dt.sum()
        self.tok_sq += dt.square().sum()

    def compute(self) -> Dict[str, float]:
        out: Dict[str, float] = {}
        n = self.n_seq
        for b, label in enumerate(self.bins.labels):
            if n[b] <= 0:
                continue
            mean = self.s_sum[b] / n[b]
            var = (self.s_sq[b] / n[b] - mean.square()).clamp(min=0.0) * n[b] / (n[b] - 1).clamp(min=1.0)
            out[f"rollout_corr/logratio_mean/{label}"] = float(mean)
            out[f"rollout_corr/logratio_std/{label}"] = float(var.sqrt())
            out[f"rollout_corr/masked_frac/{label}"] = float(self.corrected[b] / n[b])
            out[f"rollout_corr/n_seq/{label}"] = float(n[b])
        total = float(n.sum())
        if total:
            out["rollout_corr/masked_frac"] = float(self.corrected.sum()) / total
            out["rollout_corr/logratio_mean"] = float(self.s_sum.sum()) / total
        if float(self.tok_n):
            tm = self.tok_sum / self.tok_n
            out["rollout_corr/token_mean"] = float(tm)
            out["rollout_corr/token_std"] = float((self.tok_sq / self.tok_n - tm.square()).clamp(min=0.0).sqrt())
        out.update(length_fairness(n, self.corrected, self.abs_adv, self.bins, min_len=self.lre_min_len,
                                   prefix="rollout_corr/"))
        return out


class RolloutCorrection(torch.nn.Module):
    """Mismatch weights. ``cap`` > 1 caps exp(d_t) or exp(S_i) (verl 2.0, TRL 3.0); ``cap_min`` null or in [0, 1)
    floors the ratio; ``z`` > 0 the fair band's width in std; ``quantile``: `QuantileBand` keyword arguments.
    ``old_log_probs`` and ``temperature`` mirror ppo's; ``bin_width``, ``max_len``, ``lre_min_len``: the bins."""

    def __init__(self, mode: str = SETTINGS.mode, cap: float = SETTINGS.cap, z: float = SETTINGS.z,
                 band: str = SETTINGS.band, quantile: Optional[dict] = None, old_log_probs: str = "recompute",
                 temperature: float = 1.0, bin_width: int = 200, max_len: int = 32768, lre_min_len: float = 0,
                 cap_min: Optional[float] = SETTINGS.cap_min, off_policy_mask: str = SETTINGS.off_policy_mask,
                 off_policy_threshold: Optional[float] = SETTINGS.off_policy_threshold) -> None:
        super().__init__()
        self.opsm = OffPolicyMask(off_policy_mask, off_policy_threshold,
                                  LengthBins(width=int(bin_width), max_len=int(max_len)))
        if mode not in MODES:
            raise ValueError(f"rollout_correction.mode must be one of {', '.join(MODES)}, got {mode!r}")
        if band not in BANDS:
            raise ValueError(f"rollout_correction.band must be one of {', '.join(BANDS)}, got {band!r}")
        if not (isinstance(cap, (int, float)) and not isinstance(cap, bool) and math.isfinite(cap) and cap > 1):
            raise ValueError(f"rollout_correction.cap must be a number > 1 (verl 2.0, TRL 3.0), got {cap!r}")
        if not (isinstance(z, (int, float)) and not isinstance(z, bool) and math.isfinite(z) and z > 0):
            raise ValueError(f"rollout_correction.z must be a number > 0 (e.g. 3.0), got {z!r}")
        if cap_min is not None and not (isinstance(cap_min, (int, float)) and not isinstance(cap_min, bool)
                                        and 0 <= cap_min < 1):
            raise ValueError(f"rollout_correction.cap_min must be null (the peers' default) or a number in [0, 1) "
                             f"(the ratio floor; 0: none), got {cap_min!r}")
        self.mode, self.cap, self.z = mode, float(cap), float(z)
        floor = cap_min if cap_min is not None else (1.0 / self.cap if mode == "seq_mask" else 0.0)
        self.log_floor = math.log(floor) if floor > 0 else -math.inf  # log of the fixed modes' ratio floor
        if self.reweights and old_log_probs != "recompute":
            raise ValueError(
                f"rollout_correction.mode={mode} needs ppo.old_log_probs=recompute (got {old_log_probs!r}): with the "
                f"engine's log-probs as the old ones the mismatch is zero by construction; set "
                f"rollout.old_log_probs=recompute (rollout=vllm does)")
        if self.enabled and float(temperature) != 1.0:
            raise ValueError(
                f"rollout_correction.mode={mode}, off_policy_mask={off_policy_mask} needs ppo.logprob_temperature 1 "
                f"(got {temperature}): the engines report untempered log-probs; set rollout.sampling.temperature=1.0 "
                f"or rollout_correction.mode=none")
        self.band = QuantileBand(z=self.z, max_len=max(int(max_len), 2), **dict(quantile or {})) \
            if self.reweights and band == "quantile" else None
        self.metrics = CorrectionMetrics(LengthBins(width=int(bin_width), max_len=int(max_len)), lre_min_len) \
            if self.reweights else None
        self.m, self.s = 0.0, 0.0  # the step's drift per token and sqrt-law scale (the fair band's)

    @property
    def reweights(self) -> bool:
        """A mismatch mode is on (it needs the trainer's recomputed old log-probs)."""
        return self.mode != "none"

    @property
    def enabled(self) -> bool:
        """A mode or the off-policy mask is on."""
        return self.reweights or self.opsm.enabled

    @staticmethod
    def _inputs(batch) -> Tuple[Tensor, Tensor, Tensor]:
        if batch.engine_log_probs is None or batch.old_log_probs is None:
            raise ValueError("rollout_correction needs the engine's log-probs (VLLMEngine always reports them, "
                             "HFEngine with rollout.engine.compact=true) and the trainer's old log-probs")
        return batch.old_log_probs, batch.engine_log_probs, batch.response_mask

    @torch.no_grad()
    def fit(self, batch) -> None:
        """Once per step on this rank's rollout: the band's m and s and the quantile band's observation (all ranks),
        and the diagnostics of this rank's rows."""
        if not self.reweights:
            return
        old, eng, mask = self._inputs(batch)
        d, seq, length = mismatch(old, eng, mask)
        pos = length > 0
        n_tok, s1, n_seq, q = reduce_sum([length.sum(), seq.sum(), pos.sum(),
                                          (seq[pos].square() / length[pos]).sum()], mask.device)
        self.m = s1 / n_tok if n_tok else 0.0  # drift per token
        # sqrt-law scale: s^2 = mean over sequences of (S - m L)^2 / L
        self.s = math.sqrt(max((q - 2 * self.m * s1 + self.m ** 2 * n_tok) / n_seq, 0.0)) if n_seq else 0.0
        if self.band is not None:
            self.band.observe(seq, length, mu=self.m * length)
        if self.metrics is not None:
            _, corrected = self._weights(d, seq, length, mask)
            self.metrics.update(d, seq, length, corrected, mask, batch.advantages)

    def half_width(self, length: Tensor) -> Tensor:
        """h(L) of the fair band, float64 [B]: z s sqrt(L) (sqrt) or the quantile band's z scale(L)."""
        length = length.to(torch.float64)
        if self.band is not None:
            return self.z * self.band.scale(length).to(length.device, torch.float64)
        return self.z * self.s * length.clamp(min=0.0).sqrt()

    def _weights(self, d: Tensor, seq: Tensor, length: Tensor, mask: Tensor) -> Tuple[Tensor, Tensor]:
        """(weights [B, T] float32 on the mask, corrected [B] float64 in [0, 1])."""
        m = mask.to(torch.float64)
        log_cap, log_lo = math.log(self.cap), max(self.log_floor, -_MAX_LOG)
        if self.mode == "token_tis":
            w = d.clamp(min=log_lo, max=log_cap).exp()
            out = ((d > log_cap) | (d < self.log_floor)) & mask.bool()
            return (w * m).float(), out.to(torch.float64).sum(-1) / length.clamp(min=1.0)
        if self.mode in ("seq_is", "seq_mask", "seq_masked_is"):
            s = d.clamp(-_MAX_LOG, _MAX_LOG).sum(-1) if self.mode == "seq_mask" else seq
            hit = (s > log_cap) | (s < self.log_floor)
            if self.mode == "seq_is":
                w = s.clamp(min=log_lo, max=log_cap).exp()
            elif self.mode == "seq_mask":
                w = (~hit).to(torch.float64)
            else:  # seq_masked_is
                w = torch.where(hit, 0.0, s.clamp(-_MAX_LOG, _MAX_LOG).exp())
        else:
            mu, h = self.m * length, self.half_width(length)
            if self.mode == "seq_fair_mask":
                hit = (seq - mu).abs() > h
                w = (~hit).to(torch.float64)
            else:  # seq_fair_tis
                top = mu + h
                hit = seq > top
                w = torch.minimum(seq, top).clamp(min=-_MAX_LOG, max=_MAX_LOG).exp()
        hit = hit & (length > 0)
        return (w[:, None] * m).float(), hit.to(torch.float64)

    @torch.no_grad()
    def weights(self, batch, current: Optional[Tensor] = None) -> Tensor:
        """The detached per-token weights [B, T] of ``batch`` (a micro-batch), with the step's `fit`; with the
        off-policy mask on, times keep_i from ``current`` (this micro-batch's log-probs under the policy now)."""
        mask = batch.response_mask
        w = torch.ones(mask.shape, device=mask.device) * mask
        if self.reweights:
            old, eng, mask = self._inputs(batch)
            d, seq, length = mismatch(old, eng, mask)
            w = self._weights(d, seq, length, mask)[0].to(old.device)
        if self.opsm.enabled:
            if current is None:
                raise ValueError("rollout_correction.off_policy_mask needs the current log-probs: "
                                 "weights(batch, current)")
            eng = batch.engine_log_probs if batch.engine_log_probs is not None else batch.old_log_probs
            w = w * self.opsm.keep(eng, current, batch.advantages, mask)[:, None].to(w)
        return w

    def compute_metrics(self) -> Dict[str, float]:
        """The step's diagnostics (reduced over ranks), then reset."""
        out = self.opsm.compute_metrics()
        if self.metrics is None:
            return out
        out.update(self.metrics.compute() if self.metrics.update_count else {})
        self.metrics.reset()
        out["rollout_corr/band_m"], out["rollout_corr/band_s"] = float(self.m), float(self.s)
        return out
