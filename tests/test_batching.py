"""Mini-batches, token-budget micro-batches and the resumable prompt sampler (fspo/batching.py)."""
from __future__ import annotations

import itertools

import pytest
import torch

from fspo.batching import PromptStepSampler, minibatch_indices, token_budget_micro_batches


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
