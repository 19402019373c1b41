"""Dynamic sampling (DAPO's "filter groups"; verl's ``algorithm.filter_groups``): between rollout and update.

Owns: `GroupFilter` (the settings ``rollout.dynamic_sampling``: ``enable``, ``metric``, ``max_rounds``;
verl's enable / metric / max_num_gen_batches) and `informative_groups`. Leaves out: generating and
scoring a round (callback.py passes them in as functions), drawing the prompts
(`fspo.data.sampler.PromptStepSampler.draw`) and the advantages (computed by the callback on the batch
this returns).

Contract, for one RL step on each data-parallel rank (W ranks; one process is W = 1):

- Round 1 is the step's own batch: this rank's ``target`` prompts (``prompts_per_step / W``) with G
  completions each, scored. A group is *informative* when its G values of ``metric`` are not all
  equal (equal values give every completion advantage 0 under every group-relative estimator: no
  learning signal); the others are dropped.
- After each round every rank all-reduces (MIN) its count of informative groups so far; the
  common count ``m`` is the same on every rank. While ``m < target`` and fewer than ``max_rounds``
  rounds ran, every rank runs one more round: the callback draws the next ``prompts_per_step``
  prompts of the sampler's stream (the same on every rank, counted in the sampler's checkpointed
  ``extra``) and this rank takes its own contiguous ``1/W`` slice, as for the step's batch. The
  decision uses only all-reduced numbers, so every rank runs the same rounds (FSDP generation stays
  in lockstep).
- The step trains on ``c = min(m, target)`` groups per rank (so ``c * W`` in all, the same on every
  rank): each rank's first ``c`` informative groups in generation order (round, then prompt); a
  rank's further informative groups are left out. Fewer than ``target`` (``max_rounds`` reached)
  is a *short* step: it trains on what there is. With ``m = 0`` it trains on one group per rank
  (its first informative group if it has one, else its first group, whose advantages are 0), so
  the update always has rows.
- The returned batch has group ids ``0 .. c-1`` (its groups in the order above), rewards set and
  advantages unset (the callback computes them on it).

Metrics (sums over ranks): ``dynamic_sampling/filtered_frac`` (uninformative groups / groups generated),
``dynamic_sampling/rounds``, ``dynamic_sampling/short`` (1 when the step trains on fewer than
``prompts_per_step`` groups), ``dynamic_sampling/groups`` (groups trained, all ranks) and
``dynamic_sampling/prompts_drawn`` (prompts generated for, all ranks and rounds).

``metric``: ``score`` (also verl's ``seq_reward`` / ``seq_final_reward``) is the reward itself; ``acc``
is the reward's ``correct`` component, or the reward where it has none; any other name is that
reward component. ``max_rounds`` must be >= 1 (verl's ``max_num_gen_batches <= 0``, unbounded, is not
offered: a task the policy always or never solves would loop forever).
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
    """Dynamic sampling; see the module docstring. ``enable`` false: the callback does not call it."""

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
        """The step's training batch and its metrics. ``first``: round 1 (this rank's share of the step's
        batch); ``more(j)``: round ``j + 1`` (j = 1, 2, ...), generated and scored by the caller;
        ``target``: groups per rank wanted (this rank's prompts per step). Collective under
        torch.distributed: every rank must call it, with the same ``target``."""
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
