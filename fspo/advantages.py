"""Outcome advantages from scalar rewards and group (prompt) ids: (rewards [B], group_ids [B]) -> advantages [B]
float32, computed in float64. A group of one, or with all rewards equal, gets exactly 0 (never NaN).
"""
from __future__ import annotations

from typing import Callable, Dict, NamedTuple

import torch
from torch import Tensor


class _Groups(NamedTuple):
    r: Tensor  # [B] float64 rewards
    n: Tensor  # [B] size of the row's group
    mean: Tensor  # [B] group mean
    flat: Tensor  # [B] bool: group of one, or all rewards in the group equal
    inv: Tensor  # [B] dense group index of each row


def _groups(fn: str, rewards: Tensor, group_ids: Tensor) -> _Groups:
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(f"advantages.{fn}: rewards shape {tuple(rewards.shape)} and group_ids shape "
                         f"{tuple(group_ids.shape)} must be equal and 1-D [B]")
    r = rewards.detach().to(torch.float64)
    if not torch.isfinite(r).all():
        raise ValueError(f"advantages.{fn}: rewards contain NaN or inf; fix the reward function output")
    uniq, inv = torch.unique(group_ids, return_inverse=True)
    n = torch.zeros(uniq.numel(), dtype=torch.float64, device=r.device).index_add_(0, inv, torch.ones_like(r))
    s = torch.zeros_like(n).index_add_(0, inv, r)
    hi = torch.full_like(n, -torch.inf).scatter_reduce(0, inv, r, "amax")
    lo = torch.full_like(n, torch.inf).scatter_reduce(0, inv, r, "amin")
    flat = (hi == lo) | (n < 2)
    return _Groups(r, n[inv], (s / n)[inv], flat[inv], inv)


def _finish(adv: Tensor, grp: _Groups) -> Tensor:
    return torch.where(grp.flat, 0.0, adv).to(torch.float32)


def grpo(rewards: Tensor, group_ids: Tensor, eps: float = 1e-6) -> Tensor:
    """GRPO: A_i = (R_i - mean_g R) / (std_g R + eps), std unbiased (torch.std, as verl)."""
    grp = _groups("grpo", rewards, group_ids)
    dev = grp.r - grp.mean
    ss = torch.zeros_like(dev).index_add_(0, grp.inv, dev * dev)[grp.inv]
    std = (ss / (grp.n - 1.0).clamp(min=1.0)).sqrt()
    return _finish(dev / (std + eps), grp)


def rloo(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """RLOO leave-one-out: A_i = R_i - mean_{j != i} R_j = n/(n-1) (R_i - mean_g R); 0 for n = 1."""
    grp = _groups("rloo", rewards, group_ids)
    return _finish((grp.r - grp.mean) * grp.n / (grp.n - 1.0).clamp(min=1.0), grp)


def drgrpo(rewards: Tensor, group_ids: Tensor) -> Tensor:
    """Dr.GRPO: A_i = R_i - mean_g R (no std normalisation)."""
    grp = _groups("drgrpo", rewards, group_ids)
    return _finish(grp.r - grp.mean, grp)


ADVANTAGES: Dict[str, Callable[..., Tensor]] = {"grpo": grpo, "rloo": rloo, "drgrpo": drgrpo}


def get_advantage_fn(name: str) -> Callable[..., Tensor]:
    """The advantage function registered as ``name``; ValueError listing the names otherwise."""
    if name not in ADVANTAGES:
        raise ValueError(f"unknown advantage estimator {name!r}; choose one of {sorted(ADVANTAGES)}")
    return ADVANTAGES[name]
