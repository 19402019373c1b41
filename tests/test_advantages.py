"""Advantage estimators: hand-computed groups, degenerate groups, verl parity, registry, yamls."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from fspo.advantages import ADVANTAGES, drgrpo, get_advantage_fn, grpo, rloo

CONF = Path(__file__).resolve().parents[1] / "conf" / "advantage"


def test_hand_computed_group():
    # one group R = (1, 0, 0, 1): mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.5773502691896258
    r = torch.tensor([1.0, 0.0, 0.0, 1.0])
    gid = torch.zeros(4, dtype=torch.long)
    a = 0.5 / (0.5773502691896258 + 1e-6)  # 0.8660239...
    torch.testing.assert_close(grpo(r, gid), torch.tensor([a, -a, -a, a]))
    # leave-one-out: 1 - (0 + 0 + 1) / 3 = 2/3, 0 - (1 + 0 + 1) / 3 = -2/3
    torch.testing.assert_close(rloo(r, gid), torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]))
    torch.testing.assert_close(drgrpo(r, gid), torch.tensor([0.5, -0.5, -0.5, 0.5]))


@pytest.mark.parametrize("fn", [grpo, rloo, drgrpo])
def test_degenerate_groups_are_exactly_zero(fn):
    # group 5: all equal (0.1 three times - not exactly representable), group 9: size 1,
    # group 2: all equal 1.0, group 4: a real group
    r = torch.tensor([0.1, 3.0, 0.1, 1.0, 0.1, 1.0, 0.0, 1.0])
    gid = torch.tensor([5, 9, 5, 2, 5, 2, 4, 4])
    out = fn(r, gid)
    assert out.dtype == torch.float32 and out.shape == (8,)
    assert torch.isfinite(out).all()
    assert out[[0, 1, 2, 3, 4, 5]].tolist() == [0.0] * 6
    assert out[6] < 0 < out[7]


def _verl_grpo(scores, index, eps=1e-6):
    # verl compute_grpo_outcome_advantage (outcome rewards): per-group mean and torch.std; a group
    # of one uses mean 0, std 1
    out = scores.clone()
    groups = {}
    for i, g in enumerate(index.tolist()):
        groups.setdefault(g, []).append(scores[i])
    for i, g in enumerate(index.tolist()):
        vals = torch.stack(groups[g])
        mean, std = (vals.mean(), vals.std()) if len(vals) > 1 else (torch.tensor(0.0), torch.tensor(1.0))
        out[i] = (scores[i] - mean) / (std + eps)
    return out


def _verl_rloo(scores, index):
    # verl compute_rloo_outcome_advantage: R * n/(n-1) - mean * n/(n-1) for n > 1
    out = scores.clone()
    groups = {}
    for i, g in enumerate(index.tolist()):
        groups.setdefault(g, []).append(scores[i])
    for i, g in enumerate(index.tolist()):
        n = len(groups[g])
        if n > 1:
            mean = torch.stack(groups[g]).mean()
            out[i] = scores[i] * n / (n - 1) - mean * n / (n - 1)
    return out


def test_verl_parity_random():
    g = torch.Generator().manual_seed(0)
    gid = torch.randperm(64, generator=g) % 8  # 8 interleaved groups of 8
    r = torch.randn(64, generator=g)
    torch.testing.assert_close(grpo(r, gid), _verl_grpo(r, gid), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rloo(r, gid), _verl_rloo(r, gid), rtol=1e-5, atol=1e-6)
    # binary rewards, typical for RLVR
    rb = (torch.rand(64, generator=g) > 0.5).float()
    torch.testing.assert_close(grpo(rb, gid), _verl_grpo(rb, gid), rtol=1e-5, atol=1e-6)


def test_advantages_sum_to_zero_per_group():
    g = torch.Generator().manual_seed(1)
    gid = torch.arange(40) // 5
    r = torch.rand(40, generator=g)
    for fn in (grpo, rloo, drgrpo):
        sums = torch.zeros(8).index_add_(0, gid, fn(r, gid))
        torch.testing.assert_close(sums, torch.zeros(8), atol=1e-5, rtol=0)


def test_registry_and_errors():
    assert set(ADVANTAGES) == {"grpo", "rloo", "drgrpo"}
    assert get_advantage_fn("rloo") is rloo
    with pytest.raises(ValueError, match=r"'ppo'.*\['drgrpo', 'grpo', 'rloo'\]"):
        get_advantage_fn("ppo")
    with pytest.raises(ValueError, match=r"rewards shape \(3,\) and group_ids shape \(4,\)"):
        grpo(torch.zeros(3), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="NaN"):
        rloo(torch.tensor([1.0, float("nan")]), torch.zeros(2, dtype=torch.long))


@pytest.mark.parametrize("path", sorted(CONF.glob("*.yaml")), ids=lambda p: p.stem)
def test_advantage_yamls_instantiate(path):
    fn = instantiate(OmegaConf.load(path))
    r = torch.tensor([1.0, 0.0, 1.0, 1.0])
    out = fn(r, torch.tensor([0, 0, 1, 1]))
    assert out.shape == (4,) and out[2:].tolist() == [0.0, 0.0] and out[0] > 0 > out[1]
    assert {p.stem for p in CONF.glob("*.yaml")} == {"grpo", "rloo", "drgrpo"}
