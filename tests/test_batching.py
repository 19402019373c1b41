"""Mini-batches, token-budget micro-batches and the resumable prompt sampler (fspo/update/microbatches.py)."""
from __future__ import annotations

import itertools

import pytest
import torch

from fspo.data.sampler import PromptStepSampler
from fspo.update.microbatches import (
    check_mini_batch,
    group_minibatch_indices,
    minibatch_indices,
    minibatch_plan,
    token_budget_micro_batches,
)


def check_partition(groups, n):
    flat = torch.cat(groups).tolist() if groups else []
    assert sorted(flat) == list(range(n)), "every index exactly once"


# ------------------------------------------------------------------ token-budget micro-batches
def test_micro_batches_by_hand():
    # sorted descending: 9 (i=3), 7 (i=0), 5 (i=2), 4 (i=4), 2 (i=1); budget 16 = rows * longest
    lengths = torch.tensor([7, 2, 5, 9, 4])
    groups = token_budget_micro_batches(lengths, 16)
    # [9] (adding 7 -> 2*9=18 > 16), [7, 5] (2*7=14; +4 -> 21), [4, 2] (2*4=8)
    assert [g.tolist() for g in groups] == [[3], [0, 2], [4, 1]]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("budget", [1, 7, 32, 100, 10_000])
def test_micro_batches_respect_budget_and_cover_every_index(seed, budget):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 60, (37,), generator=g)
    groups = token_budget_micro_batches(lengths, budget)
    check_partition(groups, 37)
    for grp in groups:
        padded = len(grp) * int(lengths[grp].max())
        assert padded <= budget or len(grp) == 1, (grp.tolist(), padded, budget)
        assert lengths[grp].tolist() == sorted(lengths[grp].tolist(), reverse=True)
    if budget >= 37 * 59:
        assert len(groups) == 1


def test_micro_batches_single_row_over_budget_gets_its_own_group():
    groups = token_budget_micro_batches(torch.tensor([50, 3, 3]), 10)
    assert [g.tolist() for g in groups] == [[0], [1, 2]]


def test_micro_batches_max_seqs_and_bad_budget():
    groups = token_budget_micro_batches(torch.ones(10, dtype=torch.long), 1000, max_seqs=4)
    assert [len(g) for g in groups] == [4, 4, 2]
    check_partition(groups, 10)
    with pytest.raises(ValueError, match="micro_batch_max_tokens"):
        token_budget_micro_batches(torch.tensor([1, 2]), 0)
    assert token_budget_micro_batches(torch.tensor([], dtype=torch.long), 8) == []


# ------------------------------------------------------------------ PPO mini-batches
def test_minibatch_indices_partition_sizes_and_determinism():
    mbs = minibatch_indices(10, 4, torch.Generator().manual_seed(0))
    assert [len(m) for m in mbs] == [4, 4, 2]
    check_partition(mbs, 10)
    again = minibatch_indices(10, 4, torch.Generator().manual_seed(0))
    assert [m.tolist() for m in mbs] == [m.tolist() for m in again]
    other = minibatch_indices(10, 4, torch.Generator().manual_seed(1))
    assert [m.tolist() for m in mbs] != [m.tolist() for m in other]
    assert [m.tolist() for m in minibatch_indices(5, 2, shuffle=False)] == [[0, 1], [2, 3], [4]]
    assert [m.tolist() for m in minibatch_indices(4, 8, shuffle=False)] == [[0, 1, 2, 3]]
    with pytest.raises(ValueError, match="mini_batch_size"):
        minibatch_indices(4, 0)


def test_sequence_plan_is_the_plain_permutation():
    """ppo.mini_batch_unit=sequences: the plan is torch.randperm split into mini-batches, epoch after
    epoch from one generator, exactly as before the unit existed (same shuffles at the same seed)."""
    for b_size, m, epochs in [(128, 32, 1), (10, 4, 3), (16, 16, 2)]:
        got = minibatch_plan(b_size, m, epochs, torch.Generator().manual_seed(7))
        g = torch.Generator().manual_seed(7)
        want = [mb for _ in range(epochs) for mb in torch.randperm(b_size, generator=g).split(m)]
        assert [x.tolist() for x in got] == [x.tolist() for x in want]
        # group ids are ignored in this unit
        again = minibatch_plan(b_size, m, epochs, torch.Generator().manual_seed(7), "sequences",
                               torch.zeros(b_size, dtype=torch.long))
        assert [x.tolist() for x in again] == [x.tolist() for x in want]


def _check_whole_groups(mbs, group_ids, groups_per_mb):
    check_partition(mbs, len(group_ids))
    sizes = torch.bincount(group_ids)
    for i, mb in enumerate(mbs):
        gs = group_ids[mb].unique()
        assert all(int((group_ids[mb] == g).sum()) == int(sizes[g]) for g in gs), "a group is split"
        assert len(gs) == groups_per_mb or (i == len(mbs) - 1 and len(gs) < groups_per_mb)


@pytest.mark.parametrize("seed", range(4))
def test_group_minibatches_hold_whole_groups_and_cover_every_row(seed):
    n, prompts, m = 16, 128, 32  # the paper's step: 4 mini-batches of 32 groups = 512 sequences
    group_ids = torch.arange(prompts).repeat_interleave(n)
    mbs = group_minibatch_indices(group_ids, m, torch.Generator().manual_seed(seed))
    assert [len(x) for x in mbs] == [m * n] * 4
    _check_whole_groups(mbs, group_ids, m)
    # a group's rows are contiguous inside its mini-batch, in batch order
    for mb in mbs:
        for k in range(m):
            rows = mb[k * n:(k + 1) * n]
            assert group_ids[rows].unique().numel() == 1 and rows.tolist() == sorted(rows.tolist())


def test_group_minibatches_deterministic_and_shuffle_groups():
    group_ids = torch.arange(12).repeat_interleave(4)
    a = group_minibatch_indices(group_ids, 3, torch.Generator().manual_seed(0))
    b = group_minibatch_indices(group_ids, 3, torch.Generator().manual_seed(0))
    c = group_minibatch_indices(group_ids, 3, torch.Generator().manual_seed(1))
    assert [x.tolist() for x in a] == [x.tolist() for x in b]
    assert [x.tolist() for x in a] != [x.tolist() for x in c]
    # the groups, not the rows, are permuted: by the generator's randperm over the 12 groups
    order = torch.randperm(12, generator=torch.Generator().manual_seed(0))
    assert [group_ids[x].unique_consecutive().tolist() for x in a] == [o.tolist() for o in order.split(3)]
    # without shuffling: groups in order
    assert [x.tolist() for x in group_minibatch_indices(torch.arange(6) // 2, 2, shuffle=False)] == \
        [[0, 1, 2, 3], [4, 5]]


def test_group_minibatches_any_ids_and_sizes():
    """Group ids need not be contiguous, sorted or start at 0, and groups may differ in size."""
    group_ids = torch.tensor([7, 3, 7, 9, 3, 3, 100, 9, 7, 7])
    mbs = group_minibatch_indices(group_ids, 2, torch.Generator().manual_seed(3))
    dense = torch.unique(group_ids, return_inverse=True)[1]
    _check_whole_groups(mbs, dense, 2)
    assert len(mbs) == 2
    assert group_minibatch_indices(torch.zeros(0, dtype=torch.long), 2) == []
    with pytest.raises(ValueError, match="mini_batch_size"):
        group_minibatch_indices(group_ids, 0)


def test_group_plan_epochs_cover_every_row_once_per_epoch():
    n, prompts, m, epochs = 4, 8, 2, 3
    group_ids = torch.arange(prompts).repeat_interleave(n)
    plan = minibatch_plan(prompts * n, m, epochs, torch.Generator().manual_seed(0), "prompts", group_ids)
    per_epoch = prompts // m
    assert len(plan) == epochs * per_epoch
    for e in range(epochs):
        _check_whole_groups(plan[e * per_epoch:(e + 1) * per_epoch], group_ids, m)
    assert [x.tolist() for x in plan[:per_epoch]] != [x.tolist() for x in plan[per_epoch:2 * per_epoch]]  # reshuffled
    with pytest.raises(ValueError, match="group ids"):
        minibatch_plan(prompts * n, m, 1, None, "prompts", None)
    with pytest.raises(ValueError, match="mini_batch_unit"):
        minibatch_plan(prompts * n, m, 1, None, "groups", group_ids)


def test_check_mini_batch_counts_updates_and_names_the_fix():
    assert check_mini_batch(128, 16, 32, "prompts") == 4      # the paper: 128 prompts, mini-batch 32 prompts
    assert check_mini_batch(16, 8, 32, "sequences") == 4      # the default run: 128 sequences / 32
    assert check_mini_batch(5, 2, 4, "sequences") == 3        # sequences: the last mini-batch may be smaller
    with pytest.raises(ValueError, match=r"ppo.mini_batch_size=32 prompts .*prompts_per_step=8 .*"
                                         r"rollout.sampling.n=16 .*ppo.mini_batch_unit=sequences"):
        check_mini_batch(8, 16, 32, "prompts")                # the old reading of the table in prompts
    with pytest.raises(ValueError, match=r"ppo.mini_batch_size=32 sequences .*= 16 sequences.* <= 16"):
        check_mini_batch(2, 8, 32, "sequences")
    with pytest.raises(ValueError, match=r"prompts_per_step=48 does not split .*ppo.mini_batch_size=32"):
        check_mini_batch(48, 16, 32, "prompts")
    with pytest.raises(ValueError, match="ppo.mini_batch_unit must be one of sequences, prompts"):
        check_mini_batch(8, 16, 4, "groups")
    with pytest.raises(ValueError, match="ppo.mini_batch_size must be >= 1"):
        check_mini_batch(8, 16, 0, "prompts")


# ------------------------------------------------------------------ prompt sampler
def test_sampler_yields_exactly_steps_batches_and_is_deterministic():
    s = PromptStepSampler(num_prompts=10, prompts_per_step=4, steps=7, seed=3)
    assert len(s) == 7
    batches = list(s)
    assert len(batches) == 7 and all(len(b) == 4 for b in batches)
    assert len(s) == 0 and list(s) == []  # exhausted: nothing more
    assert batches == list(PromptStepSampler(10, 4, 7, seed=3))
    assert batches != list(PromptStepSampler(10, 4, 7, seed=4))
    # epochs: each run of 10 consecutive picks is a permutation of the 10 prompts
    flat = list(itertools.chain.from_iterable(batches))  # 28 picks: epochs 0, 1 full, 2 partial
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:20]) == list(range(10))
    assert flat[:10] != flat[10:20]  # a new permutation per epoch


@pytest.mark.parametrize("stop_after", [0, 1, 3, 6])
def test_sampler_resume_from_state_dict(stop_after):
    full = list(PromptStepSampler(7, 3, 6, seed=11))
    first = PromptStepSampler(7, 3, 6, seed=11)
    seen = list(itertools.islice(iter(first), stop_after))
    state = first.state_dict()
    assert state == {"position": stop_after}
    resumed = PromptStepSampler(7, 3, 6, seed=11)
    resumed.load_state_dict(state)
    assert len(resumed) == 6 - stop_after
    assert seen + list(resumed) == full


def test_sampler_rejects_bad_settings():
    with pytest.raises(ValueError, match="empty"):
        PromptStepSampler(0, 4, 2)
    with pytest.raises(ValueError):
        PromptStepSampler(5, 0, 2)
    assert list(PromptStepSampler(5, 2, 0)) == []
