"""Dynamic sampling (DAPO's "filter groups"; verl's ``algorithm.filter_groups``): between rollout and update.

A group is *informative* when its G values of ``metric`` are not all equal (equal values give every completion
advantage 0). Round 1 is this rank's ``target`` prompts; after each round the ranks all-reduce (MIN) their
informative counts to ``m``, and while ``m < target`` and fewer than ``max_rounds`` ran, every rank scores the
sampler's next ``prompts_per_step`` prompts (its slice). The step trains on ``c = max(1, min(m, target))`` groups
per rank, its first informative ones in generation order (with none, its first group), renumbered ``0 .. c-1``.
``metric``: ``score`` (verl's ``seq_reward`` / ``seq_final_reward``) the reward, ``acc`` its ``correct``
component (or the reward), any other name that component. Metrics: ``dynamic_sampling/filtered_frac``,
``rounds``, ``short``, ``groups``, ``prompts_drawn`` (sums over ranks).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Sequence, Tuple

import torch
from torch import Tensor

from fspo.runtime.launch.distributed import concat_rollouts, reduce_sum, sync_count
from fspo.types import RolloutBatch

SCORE_METRICS = ("score", "seq_reward", "seq_final_reward")
Round = Tuple[RolloutBatch, Sequence[float]]  # a scored round: its batch (rewards set) and the metric per row


def informative_groups(values: Tensor, group_ids: Tensor) -> Tuple[Tensor, Tensor]:
    """(the batch's distinct group ids ascending, whether each group's values are not all equal)."""
    uniq, inv = torch.unique(group_ids, return_inverse=True)
    v = values.to(torch.float64)
    hi = torch.full((len(uniq),), -torch.inf, dtype=torch.float64).scatter_reduce(0, inv, v, "amax")
    lo = torch.full((len(uniq),), torch.inf, dtype=torch.float64).scatter_reduce(0, inv, v, "amin")
    return uniq, hi != lo


class GroupFilter:
    """Dynamic sampling; ``enable`` false: the callback does not call it."""

    def __init__(self, enable: bool = False, metric: str = "acc", max_rounds: int = 3):
        if int(max_rounds) < 1:
            raise ValueError(f"rollout.dynamic_sampling.max_rounds must be >= 1 (rounds of generation per step), "
                             f"got {max_rounds}")
        self.enable, self.metric, self.max_rounds = bool(enable), str(metric), int(max_rounds)

    def values(self, scores: Sequence[float], components: Dict[str, Sequence[float]]) -> List[float]:
        """The per-completion values whose spread within a group decides (``metric``)."""
        if self.metric in SCORE_METRICS or (self.metric == "acc" and "correct" not in components):
            return [float(x) for x in scores]
        key = "correct" if self.metric == "acc" else self.metric
        if key not in components:
            raise ValueError(f"rollout.dynamic_sampling.metric={self.metric!r}: the reward has no {key!r} component; "
                             f"use one of {', '.join(list(SCORE_METRICS) + ['acc'] + sorted(components))}")
        return [float(x) for x in components[key]]

    def run(self, first: Round, more: Callable[[int], Round], target: int, device=None
            ) -> Tuple[RolloutBatch, Dict[str, float]]:
        """The step's training batch and its metrics. ``first``: round 1; ``more(j)``: round ``j + 1``, generated
        and scored by the caller; ``target``: groups per rank wanted. Collective, with the same ``target``."""
        if target < 1:
            raise ValueError(f"dynamic sampling needs at least one prompt per rank, got {target}")
        rounds: List[RolloutBatch] = []
        good: List[Tuple[int, int]] = []  # (round, group id) of informative groups, generation order
        flat: List[Tuple[int, int]] = []
        generated = 0
        batch, vals = first
        while True:
            rounds.append(batch)
            uniq, keep = informative_groups(torch.as_tensor(vals, dtype=torch.float64), batch.group_ids.cpu())
            r = len(rounds) - 1
            good += [(r, int(g)) for g, k in zip(uniq.tolist(), keep.tolist()) if k]
            flat += [(r, int(g)) for g, k in zip(uniq.tolist(), keep.tolist()) if not k]
            generated += len(uniq)
            common = -sync_count(-len(good), device)  # min over ranks: the same on every rank
            if common >= target or len(rounds) >= self.max_rounds:
                break
            batch, vals = more(len(rounds))
        c = max(1, min(common, target))
        batch = self._select(rounds, (good + flat)[:c])
        sums = reduce_sum([generated, len(flat), c, sum(int(b.group_ids.unique().numel()) for b in rounds)], device)
        return batch, {
            "dynamic_sampling/filtered_frac": sums[1] / max(sums[0], 1),
            "dynamic_sampling/rounds": float(len(rounds)),
            "dynamic_sampling/short": float(common < target),
            "dynamic_sampling/groups": sums[2],
            "dynamic_sampling/prompts_drawn": sums[3],
        }

    @staticmethod
    def _select(rounds: List[RolloutBatch], chosen: List[Tuple[int, int]]) -> RolloutBatch:
        """The rows of the ``chosen`` (round, group) pairs, group ids renumbered 0.. in ``chosen``'s order."""
        parts = []
        for r, b in enumerate(rounds):
            new = {g: i for i, (rr, g) in enumerate(chosen) if rr == r}
            if not new:
                continue
            gids = b.group_ids.cpu()
            rows = [i for i, g in enumerate(gids.tolist()) if g in new]
            part = b.select(torch.tensor(rows, dtype=torch.long, device=b.group_ids.device))
            part.group_ids = torch.tensor([new[g] for g in gids[rows].tolist()], dtype=torch.long,
                                          device=b.group_ids.device)
            parts.append(part)
        out = concat_rollouts(parts, offset_groups=False) if len(parts) > 1 else parts[0]
        order = torch.argsort(out.group_ids, stable=True)  # rows group after group, in ``chosen``'s order
        return out.select(order).validate()
