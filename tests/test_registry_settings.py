"""The registry pieces the verl / TRL adapters stand on, without either library:
`fspo_settings` (the one mapping of FSPO's settings, its lookup order and the paper's defaults),
``rollout_is_weights`` (multiplies the per-token loss, hand-computed), `fspo_loss` (the registered
``fspo`` plus its ClipResult) and fspo/diagnostics/length_counts.py (hand-computed sums)."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from fspo.clipping import FSPOClip, GRPOClip
from fspo.clipping.registry import FSPO_DEFAULTS, fspo_loss, fspo_settings, get_policy_loss_fn
from fspo.diagnostics.bins import LengthBins
from fspo.diagnostics.length_counts import count_metrics, fractions, length_counts


def test_fspo_settings_lookup_order_and_paper_defaults():
    assert FSPO_DEFAULTS == {"c_upper": 0.03, "c_lower": 0.03, "c_dual": 0.03, "ratio_grad": "per_token"}
    assert fspo_settings(None) == FSPO_DEFAULTS
    assert fspo_settings({"clip_ratio_low": 0.2, "clip_ratio_high": 0.28}) == FSPO_DEFAULTS  # ratio-space: not read
    # verl layout: the policy_loss sub-config first, then the top level, then the paper's value
    cfg = SimpleNamespace(c_upper=0.5, c_lower=0.04, policy_loss=SimpleNamespace(c_upper=0.05, c_dual=None))
    assert fspo_settings(cfg) == {"c_upper": 0.05, "c_lower": 0.04, "c_dual": None, "ratio_grad": "per_token"}
    dc = OmegaConf.create({"policy_loss": {"loss_mode": "fspo", "c_lower": 0.02}, "ratio_grad": "length_weighted"})
    assert fspo_settings(dc) == {**FSPO_DEFAULTS, "c_lower": 0.02, "ratio_grad": "length_weighted"}
    assert fspo_settings({"policy_loss": None, "c_upper": 0.04})["c_upper"] == 0.04


def test_c_dual_none_turns_the_dual_clip_off():
    # one sequence, L = 4, A = -1, S = 1.0 far above the dual bound 0.03 * 2 = 0.06
    m = torch.ones(1, 4)
    old = torch.zeros(1, 4)
    new = torch.full((1, 4), 0.25)
    adv = -torch.ones(1, 4)
    dual, _ = get_policy_loss_fn("fspo")(old, new, adv, m, "token-mean", None)
    off, _ = get_policy_loss_fn("fspo")(old, new, adv, m, "token-mean", {"c_dual": None})
    assert dual.item() == pytest.approx(math.exp(0.06))      # -A exp(du): capped
    assert off.item() == pytest.approx(math.exp(1.0), rel=1e-6)  # -A exp(S): no cap


def test_rollout_is_weights_hand_computed():
    # on-policy (S = 0): token loss -A on every token; weights w; token-mean over 3 tokens
    m = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    lp = torch.full((2, 3), -1.0)
    adv = torch.tensor([[1.0, 1.0, 0.0], [-2.0, 0.0, 0.0]])
    w = torch.tensor([[0.5, 2.0, 9.0], [3.0, 9.0, 9.0]])
    loss, _ = get_policy_loss_fn("fspo")(lp, lp, adv, m, "token-mean", None, rollout_is_weights=w)
    assert loss.item() == pytest.approx((-0.5 - 2.0 + 2.0 * 3.0) / 3)
    seq_w = torch.tensor([[2.0], [0.5]])  # TRL's [B, 1] sequence-level ratio broadcasts
    loss, _ = get_policy_loss_fn("fspo")(lp, lp, adv, m, "token-mean", None, rollout_is_weights=seq_w)
    assert loss.item() == pytest.approx((-2.0 - 2.0 + 2.0 * 0.5) / 3)
    with pytest.raises(ValueError, match="rollout_is_weights shape"):
        get_policy_loss_fn("fspo")(lp, lp, adv, m, "token-mean", None, rollout_is_weights=torch.ones(2, 3, 2))



@pytest.mark.parametrize("name", sorted(__import__("fspo.clipping.registry", fromlist=["POLICY_LOSSES"]).POLICY_LOSSES))
def test_every_registered_loss_takes_rollout_is_weights(name):
    """verl passes ``rollout_is_weights`` to every policy loss: weights of 2 on every token double the token-mean
    loss and its gradient w.r.t. log_prob (the weights are detached factors of the token loss)."""
    g = torch.Generator().manual_seed(3)
    m = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    old = -torch.rand(2, 4, generator=g)
    new = (old + 0.01 * torch.randn(2, 4, generator=g)).requires_grad_(True)
    adv = torch.tensor([[1.0] * 4, [-0.5] * 4])
    fn = get_policy_loss_fn(name)
    plain, _ = fn(old, new, adv, m, "token-mean", None)
    (g_plain,) = torch.autograd.grad(plain, new)
    weighted, _ = fn(old, new, adv, m, "token-mean", None, rollout_is_weights=torch.full((2, 4), 2.0))
    (g_weighted,) = torch.autograd.grad(weighted, new)
    assert weighted.item() == pytest.approx(2.0 * plain.item(), rel=1e-6, abs=1e-9)
    torch.testing.assert_close(g_weighted, 2.0 * g_plain)

def test_fspo_loss_is_the_registered_fspo():
    g = torch.Generator().manual_seed(0)
    m = (torch.arange(20) < torch.randint(1, 21, (8,), generator=g)[:, None]).float()
    old = -torch.rand(8, 20, generator=g)
    new = old + torch.randn(8, 1, generator=g) * 0.05
    adv = torch.randn(8, generator=g)[:, None] * m
    loss, metrics, res = fspo_loss(old, new, adv, m, "seq-mean-token-mean", {"c_upper": 0.02, "c_dual": 0.05})
    ref, ref_metrics = get_policy_loss_fn("fspo")(old, new, adv, m, "seq-mean-token-mean",
                                                  {"c_upper": 0.02, "c_dual": 0.05})
    assert torch.equal(loss, ref) and metrics == ref_metrics
    expect = FSPOClip(c_upper=0.02, c_dual=0.05)(new, old, adv, m)
    assert torch.equal(res.token_loss, expect.token_loss) and torch.equal(res.clip_upper, expect.clip_upper)


def test_length_counts_hand_computed():
    # FSPO on L = 3, 5, 250 (band 0.03 sqrt L): seq 0 S = 0.1, A > 0 -> upper clip, out of band;
    # seq 1 in band; seq 2 S = -1, A < 0 -> lower clip, out of band; an empty row counts nowhere
    T = 250
    lengths = torch.tensor([3, 5, 250, 0])
    m = (torch.arange(T) < lengths[:, None]).float()
    old = torch.full((4, T), -1.0)
    new = old + (torch.tensor([0.1, 0.0, -1.0, 0.0]) / lengths.clamp(min=1))[:, None] * m
    adv = torch.tensor([1.0, 1.0, -1.0, 1.0])[:, None] * m
    bins = LengthBins(width=200, max_len=400)
    sums = length_counts(FSPOClip()(new, old, adv, m), m, bins)
    assert sums.tolist() == [[2.0, 1.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 0.0]]
    assert fractions(sums, bins) == {"clip": {"len_00000_00200": 0.5, "len_00200_00400": 1.0},
                                     "out": {"len_00000_00200": 0.5, "len_00200_00400": 1.0}}
    keys = count_metrics(sums, bins, "p")
    assert len(keys) == 9 and keys["p/n_seq/len_00400_inf"] == 0.0 and keys["p/n_clip/len_00000_00200"] == 1.0
    # token-level rule: per-sequence fractions; GRPO with one token of 4 out of its band (ratio e^1)
    m2 = torch.ones(1, 4)
    new2 = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    sums = length_counts(GRPOClip()(new2, torch.zeros(1, 4), torch.ones(1, 4), m2), m2, LengthBins(width=8, max_len=8))
    assert sums[:, 0].tolist() == [1.0, 0.25, 0.25]
