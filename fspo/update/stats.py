"""Per-step training statistics besides the length diagnostics, token-weighted over the step's micro-batches:

    train/kl       = mean_t k3_t,  k3_t = r_t - 1 - log r_t,  r_t = exp(logp_new - logp_old)
                     (unbiased, non-negative estimate of KL(pi_old || pi_new) on samples from pi_old)
    train/entropy  = mean_t H(pi_theta(. | h_t))
    train/loss     = sum over updates of each mini-batch loss / number of updates
    perf/padding_waste = (token slots - real tokens) / real tokens over the step's forward passes
    rollout/logprob_gap = mean_t |logp_engine_t - logp_trainer_t| (when the engine reports log-probs)
"""
from __future__ import annotations

import resource
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
from torch import Tensor

from fspo.update.packing import TokenUsage

PENDING = ("loss_sum", "tokens", "kl_sum", "ent_sum", "ent_tokens", "gap_sum", "gap_tokens")


@dataclass
class StepStats:
    loss_sum: float = 0.0
    tokens: float = 0.0
    kl_sum: float = 0.0
    ent_sum: float = 0.0
    ent_tokens: float = 0.0
    grad_norms: List[float] = field(default_factory=list)
    skipped: int = 0
    guard_trips: int = 0  # updates past a divergence limit (guard.py), skipped or not
    nonfinite: bool = False
    metrics_time: float = 0.0
    gap_sum: float = 0.0
    gap_tokens: float = 0.0
    loss_time: float = 0.0  # seconds in the clip rule + aggregation (forward)
    usage: TokenUsage = field(default_factory=TokenUsage)      # token slots of the training passes
    usage_old: TokenUsage = field(default_factory=TokenUsage)  # ... of the old-log-prob pass
    update_ratio: Optional[float] = None  # ||theta_new - theta_old|| / ||theta_old||

    pending: Optional[Tensor] = None  # the sums below not yet read to the host, kept on the device (`PENDING`)

    def _add(self, **parts: Tensor) -> None:
        """Add ``parts`` (0-d tensors, names of `PENDING`) on their device; read once in `compute`."""
        ref = next(iter(parts.values()))
        v = torch.zeros(len(PENDING), dtype=torch.float64, device=ref.device)
        for k, t in parts.items():
            v[PENDING.index(k)] = t.double()
        self.pending = v if self.pending is None else self.pending + v.to(self.pending.device)

    @torch.no_grad()
    def add_micro(self, loss: Tensor, logp: Tensor, old: Tensor, entropy: Optional[Tensor], mask: Tensor) -> None:
        m = mask.float()
        n = m.sum()
        parts = dict(loss_sum=loss.detach().reshape(()), tokens=n, kl_sum=k3_sum_tensor(logp, old, mask))
        if entropy is not None:
            parts.update(ent_sum=(entropy * m).sum(), ent_tokens=n)
        self._add(**parts)

    @torch.no_grad()
    def add_gap(self, engine: Tensor, trainer: Tensor, mask: Tensor) -> None:
        """Accumulate |engine - trainer| log-prob differences on the response tokens of ``mask``."""
        m = mask.bool()
        self._add(gap_sum=(engine.float() - trainer.float()).abs()[m].sum(), gap_tokens=m.sum())

    def flush(self) -> None:
        """Read the device sums into the float fields (one host read)."""
        if self.pending is not None:
            for k, v in zip(PENDING, self.pending.tolist()):
                setattr(self, k, getattr(self, k) + v)
            self.pending = None

    def compute(self) -> Dict[str, float]:
        self.flush()
        updates = len(self.grad_norms)
        out = {
            "train/loss": self.loss_sum / max(updates, 1),
            "train/kl": self.kl_sum / max(self.tokens, 1.0),
            "train/updates": float(updates),
            "train/skipped_updates": float(self.skipped),
            "guard/trips": float(self.guard_trips),
        }
        if self.update_ratio is not None:
            out["train/update_ratio"] = self.update_ratio
        if updates:
            out["train/grad_norm"] = sum(self.grad_norms) / updates
        both = TokenUsage(self.usage.slots + self.usage_old.slots, self.usage.tokens + self.usage_old.tokens)
        if both.tokens:
            out["perf/padding_waste"] = both.waste
            out["perf/train_tokens"] = self.usage.tokens
            out["perf/old_log_probs_tokens"] = self.usage_old.tokens
        out["perf/loss_time_s"] = self.loss_time
        if self.gap_tokens:
            out["rollout/logprob_gap"] = self.gap_sum / self.gap_tokens
        if self.ent_tokens:
            out["train/entropy"] = self.ent_sum / self.ent_tokens
        return out


@torch.no_grad()
def k3_sum_tensor(logp: Tensor, old: Tensor, mask: Tensor) -> Tensor:
    """sum over the tokens of ``mask`` of k3 = r - 1 - log r, r = exp(logp - old) (log-ratio clamped to +-20),
    as a 0-d tensor on the inputs' device (no host read)."""
    m = mask.float()
    d = ((logp - old) * m).clamp(-20, 20)
    return ((torch.exp(d) - 1 - d) * m).sum()


def peak_memory_mib(device) -> float:
    """Peak memory since the last call: CUDA max allocated (then reset), else the process's peak RSS so far."""
    device = torch.device(device)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**20
        torch.cuda.reset_peak_memory_stats(device)
        return peak
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
