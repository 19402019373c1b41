"""fspo/seeds.py: each stream's seed is the fixed function its docstring states (hand-computed values), so a run
seed draws the same samples across versions; the callers use it (the rollout's step and validation seeds)."""
import pytest

from fspo.seeds import request_seed, round_seed, split_seed, step_seed, val_seed


def test_each_seed_is_the_stated_function_of_its_counters():
    assert step_seed(42, 0) == 42_000_126  # 42 * 1_000_003
    assert step_seed(42, 5, rank=2) == 42_000_126 + 5 + 2 * 7919
    assert val_seed(42, 3) == 42_000_126 + 999_999_937 + 3
    assert val_seed(42, 3, rank=1) == 42_000_126 + 999_999_937 + 3 + 7919
    assert round_seed(100, 0) == 100 and round_seed(100, 2) == 100 + 2 * 15_485_863
    assert request_seed(7, 2, 4) == 15 and request_seed(7, 2, 4, replica=1) == 15 + 1_000_003
    assert [split_seed(5, s) for s in ("train", "val", "test")] == [5, 1_000_008, 2_000_008]


def test_distinct_counters_give_distinct_seeds():
    seeds = {step_seed(s, k, r) for s in range(3) for k in range(50) for r in range(4)}
    seeds |= {val_seed(s, j, r) for s in range(3) for j in range(20) for r in range(4)}
    assert len(seeds) == 3 * 50 * 4 + 3 * 20 * 4


def test_an_unknown_split_is_refused_naming_the_valid_ones():
    with pytest.raises(ValueError, match=r"split must be one of \['test', 'train', 'val'\], got 'dev'"):
        split_seed(0, "dev")
