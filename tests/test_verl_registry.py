"""verl parity (independent re-statements of verl's formulas) and the policy-loss registry."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from fspo.clipping import FSPOClip, GRPOClip, GSPOClip, RLOOClip
from fspo.clipping.registry import POLICY_LOSSES, get_policy_loss_fn
from fspo.losses import AGG_MODES, aggregate


# ---- reference formulas, restated from verl/trainer/ppo/core_algos.py (not imported, not copied) --
def ref_masked_mean(x, m):
    return (x * m).sum() / m.sum()


def ref_agg_loss(loss_mat, mask, mode):
    """verl agg_loss with local denominators (rows here always have >= 1 token)."""
    row_sum = (loss_mat * mask).sum(-1)
    n_seq = (mask.sum(-1) > 0).float().sum()
    by_mode = {
        "token-mean": lambda: row_sum.sum() / mask.sum(),
        "seq-mean-token-sum": lambda: row_sum.sum() / n_seq,
        "seq-mean-token-mean": lambda: (row_sum / (mask.sum(-1) + 1e-8)).sum() / n_seq,
        "seq-mean-token-sum-norm": lambda: row_sum.sum() / mask.shape[-1],
    }
    return by_mode[mode]()


def ref_vanilla(old, new, adv, mask, mode, low=0.2, high=0.28, c=3.0):
    """verl compute_policy_loss_vanilla: ratio of clamped log-ratio, clip, dual clip for A < 0."""
    neg_kl = torch.clamp(new - old, -20.0, 20.0)
    ratio = torch.exp(neg_kl)
    l1 = -adv * ratio
    l2 = -adv * torch.clamp(ratio, 1 - low, 1 + high)
    clip1 = torch.maximum(l1, l2)
    l3 = -adv * c
    clip2 = torch.min(l3, clip1)
    losses = torch.where(adv < 0, clip2, clip1)
    metrics = {"actor/pg_clipfrac": ref_masked_mean(torch.gt(l2, l1).float(), mask),
               "actor/ppo_kl": ref_masked_mean(-neg_kl, mask),
               "actor/pg_clipfrac_lower": ref_masked_mean(torch.gt(clip1, l3) * (adv < 0).float(), mask)}
    return ref_agg_loss(losses, mask, mode), metrics


def ref_gspo(old, new, adv, mask, mode, low=3e-4, high=4e-4):
    """verl compute_policy_loss_gspo in the token form sg[s_i] * pi / sg[pi]; clamp at max 10."""
    neg_kl = new - old
    seq = (neg_kl * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    log_s = new - new.detach() + seq.detach().unsqueeze(-1)
    s = torch.exp(torch.clamp(log_s, max=10.0))
    l1 = -adv * s
    l2 = -adv * torch.clamp(s, 1 - low, 1 + high)
    return ref_agg_loss(torch.maximum(l1, l2), mask, mode)


def ref_rloo(old, new, adv_seq, mask, mode, low=0.4, high=0.667, c=3.0):
    """Sequence-level PPO clip (TRL RLOO) with verl's dual clip, broadcast over tokens."""
    s = torch.exp(torch.clamp(((new - old) * mask).sum(-1), -20.0, 20.0))
    l1, l2 = -adv_seq * s, -adv_seq * torch.clamp(s, 1 - low, 1 + high)
    clip1 = torch.maximum(l1, l2)
    losses = torch.where(adv_seq < 0, torch.min(-adv_seq * c, clip1), clip1)
    return ref_agg_loss(losses[:, None] * mask, mask, mode)


# ---- inputs -----------------------------------------------------------------------------------
def batch(seed, scale, B=24, T=64):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T
    m = (torch.arange(T) < lengths[:, None]).float()
    old = -torch.rand(B, T, generator=g) * 3
    new = (old + torch.randn(B, T, generator=g) * scale).requires_grad_(True)
    with torch.no_grad():
        new[0, :3] = old[0, :3] + torch.tensor([30.0, -30.0, 25.0])  # beyond the +-20 clamp
    adv_seq = torch.randn(B, generator=g)
    adv_seq[0], adv_seq[1] = -1.0, 0.0  # row 0 carries the +-30 tokens: dual clip binds
    return old, new, adv_seq, m


def grads(loss, x):
    (g,) = torch.autograd.grad(loss, x)
    return g


@pytest.mark.parametrize("mode", AGG_MODES)
def test_vanilla_parity_every_mode(mode):
    old, new, a, m = batch(0, 0.3)
    adv = a[:, None] * m + 0.1 * torch.randn(m.shape, generator=torch.Generator().manual_seed(9)) * m
    ref, ref_metrics = ref_vanilla(old, new, adv, m, mode)
    res = GRPOClip()(new, old, adv, m)
    ours = aggregate(res.token_loss, m, mode).loss
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grads(ours, new), grads(ref, new), rtol=1e-5, atol=1e-9)
    loss, metrics = get_policy_loss_fn("vanilla")(old, new, adv, m, mode, {"clip_ratio": 0.2,
                                                                          "clip_ratio_high": 0.28})
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-7)
    assert set(metrics) == set(ref_metrics)
    for k, v in ref_metrics.items():
        assert metrics[k] == pytest.approx(v.item(), rel=1e-5, abs=1e-7), k
    assert metrics["actor/pg_clipfrac"] > 0 and metrics["actor/pg_clipfrac_lower"] > 0


@pytest.mark.parametrize("mode", AGG_MODES)
def test_gspo_parity_every_mode(mode):
    old, new, a, m = batch(1, 0.01)
    adv = a[:, None] * m
    ref = ref_gspo(old, new, adv, m, mode)
    res = GSPOClip()(new, old, adv, m)
    assert res.clipped.any() and not res.clipped.all()
    ours = aggregate(res.token_loss, m, mode).loss
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grads(ours, new), grads(ref, new), rtol=1e-5, atol=1e-9)
    # the registry, like verl, aggregates GSPO with seq-mean-token-mean whatever the mode says
    loss, _ = get_policy_loss_fn("gspo")(old, new, adv, m, mode, None)
    torch.testing.assert_close(loss, ref_gspo(old, new, adv, m, "seq-mean-token-mean"), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_rloo_parity_every_mode(mode):
    old, new, a, m = batch(2, 0.05)
    ref = ref_rloo(old, new, a, m, mode)
    ours = aggregate(RLOOClip()(new, old, a, m).token_loss, m, mode).loss
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grads(ours, new), grads(ref, new), rtol=1e-5, atol=1e-9)
    loss, _ = get_policy_loss_fn("rloo")(old, new, a[:, None] * m, m, mode, None)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_fspo_registry_matches_module(mode):
    old, new, a, m = batch(3, 0.01)
    cfg = SimpleNamespace(c_upper=0.02, c_lower=0.025, c_dual=0.05)
    loss, metrics = get_policy_loss_fn("fspo")(old, new, a[:, None] * m, m, mode, cfg)
    res = FSPOClip(c_upper=0.02, c_lower=0.025, c_dual=0.05)(new, old, a, m)
    torch.testing.assert_close(loss, aggregate(res.token_loss, m, mode).loss)
    frac = ((res.clip_upper | res.clip_lower).float() * m).sum() / m.sum()
    assert metrics["actor/pg_clipfrac"] == pytest.approx(frac.item())


def test_registry_names_and_config_forms():
    assert set(POLICY_LOSSES) == {"vanilla", "grpo", "rloo", "gspo", "fspo"}
    assert get_policy_loss_fn("vanilla") is get_policy_loss_fn("grpo")
    with pytest.raises(ValueError, match=r"'ppo2'.*\['fspo', 'grpo', 'gspo', 'rloo', 'vanilla'\]"):
        get_policy_loss_fn("ppo2")
    old, new, a, m = batch(4, 0.3)
    adv = a[:, None] * m
    fn = get_policy_loss_fn("grpo")
    ref, _ = ref_vanilla(old, new, adv, m, "token-mean", low=0.1, high=0.1, c=2.0)
    for cfg in ({"clip_ratio": 0.1, "clip_ratio_c": 2.0},
                SimpleNamespace(clip_ratio=0.1, clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=2.0),
                OmegaConf.create({"clip_ratio": 0.1, "clip_ratio_low": 0.1, "clip_ratio_c": 2.0})):
        loss, _ = fn(old, new, adv, m, "token-mean", cfg)
        torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-7)
    # bad settings surface as the rule's ValueError naming the setting
    with pytest.raises(ValueError, match="clip_ratio_c"):
        fn(old, new, adv, m, "token-mean", {"clip_ratio_c": 0.9})
    with pytest.raises(ValueError, match="c_dual"):
        get_policy_loss_fn("fspo")(old, new, adv, m, "token-mean", {"c_upper": 0.05, "c_dual": 0.03})
    with pytest.raises(ValueError, match="loss_agg_mode"):
        fn(old, new, adv, m, "mean", None)
    with pytest.raises(ValueError, match=r"old_log_prob shape"):
        fn(old[:, :10], new, adv, m, "token-mean", None)
