"""`ShortestGroupsOnly`: advantages kept for the shortest groups only, the length law's knock-out.

When only short responses carry advantages, the update moves short responses' log-probs most, so the std of
S_L flattens in L and the fitted exponent falls (docs/length_law.md); this arm shows it on purpose.

    mask_i = 1  if mean response length of i's group <= the ``fraction`` quantile of the batch's group means
             0  otherwise                                          (whole groups: advantages stay centred)
"""
from __future__ import annotations

import torch
from torch import Tensor


class ShortestGroupsOnly:
    """mask [B] float: 1 on the groups whose mean response length is among the shortest ``fraction``."""

    def __init__(self, fraction: float = 1 / 3):
        if not 0 < float(fraction) <= 1:
            raise ValueError(f"advantage_mask.fraction must be in (0, 1], got {fraction}")
        self.fraction = float(fraction)

    def __call__(self, lengths: Tensor, group_ids: Tensor) -> Tensor:
        uniq, inv = torch.unique(group_ids, return_inverse=True)
        L = lengths.to(torch.float64)
        mean = torch.zeros(len(uniq), dtype=torch.float64, device=L.device).index_add_(0, inv, L)
        mean = mean / torch.bincount(inv, minlength=len(uniq)).clamp(min=1)
        cut = torch.quantile(mean, self.fraction)
        return (mean <= cut)[inv].to(torch.float32)
