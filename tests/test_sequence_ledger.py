"""The per-sequence records of a run (fspo/diagnostics/ledger.py) and their end-of-run summary."""
import numpy as np
import pytest
import torch

from fspo.diagnostics.law_summary import law_summary
from fspo.diagnostics.ledger import COLUMNS, SequenceLedger, ledger_arrays, read_csv, write_csv
from fspo.rollout.knockout import ShortestGroupsOnly


def test_ledger_records_by_hand(tmp_path):
    led = SequenceLedger()
    d = torch.tensor([[0.1, -0.2, 0.0], [0.3, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    in_band = torch.tensor([[True, True, False], [False, False, False]])
    led.update(7, 2, torch.tensor([4, 5]), torch.tensor([2, 1]), d, mask, torch.tensor([1.5, -0.5]), in_band)
    a = ledger_arrays(led.compute())
    assert a["step"].tolist() == [7, 7] and a["update"].tolist() == [2, 2] and a["group"].tolist() == [4, 5]
    assert a["length"].tolist() == [2, 1]
    assert a["s"] == pytest.approx([-0.1, 0.3]) and a["d2"] == pytest.approx([0.05, 0.09])
    assert a["adv"].tolist() == [1.5, -0.5] and a["out"].tolist() == [0.0, 1.0]
    back = read_csv(write_csv(led.compute(), tmp_path / "s.csv"))
    assert set(back) == set(COLUMNS) and back["s"] == pytest.approx([-0.1, 0.3])


def test_ledger_state_round_trips_through_the_checkpoint_copy():
    from fspo.runtime.checkpoints.resume_state import load_metric_states, metric_states

    root = torch.nn.Module()
    root.ledger = SequenceLedger()
    root.ledger.update(1, 1, torch.tensor([0]), torch.tensor([1]), torch.tensor([[0.5]]), torch.tensor([[1]]),
                       torch.tensor([1.0]), torch.tensor([[True]]))
    saved = metric_states(root)
    other = torch.nn.Module()
    other.ledger = SequenceLedger()
    load_metric_states(other, saved)
    assert torch.equal(other.ledger.compute(), root.ledger.compute())


def test_law_summary_under_the_law():
    rng = np.random.default_rng(0)
    n_prompts, g = 300, 8
    L = np.repeat(6.0 * np.floor(np.exp(rng.uniform(np.log(4), np.log(101), n_prompts))), g)
    S = rng.normal(0, 0.05 * np.sqrt(L))
    rec = {"step": np.repeat(np.arange(n_prompts) // 16, g), "update": 1 + np.repeat(np.arange(n_prompts) // 4 % 3, g),
           "group": np.repeat(np.arange(n_prompts) % 16, g), "length": L, "s": S, "d2": 0.0025 * L,
           "adv": np.zeros_like(L), "out": (np.abs(S) > 0.05 * np.sqrt(L)).astype(float)}
    out = law_summary(rec, min_count=50, n_boot=50)
    assert out["law/std_exponent_ci_lo"] < 0.5 < out["law/std_exponent_ci_hi"]
    assert out["law/var_inflation"] == pytest.approx(1.0, abs=0.15)
    assert out["law/own/p_homogeneity"] > 0.01 and out["law/span"] > 16
    assert out["law/bands/rloo/ratio_last_first"] > 3
    assert "law/gate/std_exponent" not in out


def test_shortest_groups_only_keeps_whole_short_groups():
    lengths = torch.tensor([10, 12, 100, 90, 50, 60])
    groups = torch.tensor([0, 0, 1, 1, 2, 2])  # group means 11, 95, 55
    assert ShortestGroupsOnly(1 / 3)(lengths, groups).tolist() == [1, 1, 0, 0, 0, 0]
    assert ShortestGroupsOnly(1.0)(lengths, groups).tolist() == [1] * 6
    with pytest.raises(ValueError, match="fraction"):
        ShortestGroupsOnly(0)
