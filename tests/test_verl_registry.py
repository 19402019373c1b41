"""verl parity (independent re-statements of verl 0.9.1's formulas) and the policy-loss registry.

tests/test_verl_parity.py compares with verl itself when it is installed; this file needs no verl.
"""
from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from fspo.clipping import FSPOClip, GRPOClip, GSPOClip, RLOOClip
from fspo.clipping.registry import POLICY_LOSSES, get_policy_loss_fn
from fspo.losses import AGG_MODES, aggregate

#: whether the sequence-level rules take ``ratio_grad`` (per-token vs length-weighted gradient form)
HAS_RATIO_GRAD = "ratio_grad" in inspect.signature(RLOOClip.__init__).parameters


# ---- reference formulas, restated from verl/trainer/ppo/core_algos.py (not imported, not copied) --
def ref_masked_mean(x, m):
    return (x * m).sum() / m.sum()


def ref_agg_loss(loss_mat, mask, mode):
    """verl 0.9.1 agg_loss with local denominators, dp_size 1 (rows here always have >= 1 token)."""
    row_sum = (loss_mat * mask).sum(-1)
    n_seq = (mask.sum(-1) > 0).float().sum()
    by_mode = {
        "token-mean": lambda: row_sum.sum() / mask.sum(),
        "token-sum": lambda: row_sum.sum(),
        "seq-mean-token-sum": lambda: row_sum.sum() / n_seq,
        "seq-mean-token-mean": lambda: (row_sum / (mask.sum(-1) + 1e-8)).sum() / n_seq,
        "seq-mean-token-sum-norm": lambda: row_sum.sum() / n_seq / mask.shape[-1],
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


def ref_rloo(old, new, adv_seq, mask, mode, low=0.4, high=0.667, c=3.0, per_token=True):
    """Sequence-level PPO clip (TRL RLOO) with verl's dual clip on every token of the sequence.
    ``per_token``: log s_{i,t} = sg(S_i) + new_t - sg(new_t) (verl GSPO's form of a sequence ratio);
    otherwise log s_i = S_i itself broadcast (gradient through S_i on each of the L_i tokens)."""
    seq = ((new - old) * mask).sum(-1)
    log_s = new - new.detach() + seq.detach()[:, None] if per_token else seq[:, None].expand_as(new)
    s = torch.exp(torch.clamp(log_s, -20.0, 20.0))
    a = adv_seq[:, None]
    l1, l2 = -a * s, -a * torch.clamp(s, 1 - low, 1 + high)
    clip1 = torch.maximum(l1, l2)
    losses = torch.where(a < 0, torch.min(-a * c, clip1), clip1)
    return ref_agg_loss(losses * mask, mask, mode)


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
    (g,) = torch.autograd.grad(loss, x, retain_graph=True)
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
    # the registry, like verl 0.9.1, aggregates GSPO with loss_agg_mode ...
    loss, _ = get_policy_loss_fn("gspo")(old, new, adv, m, mode, None)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-7)
    # ... whose default argument is seq-mean-token-mean
    loss, _ = get_policy_loss_fn("gspo")(old, new, adv, m)
    torch.testing.assert_close(loss, ref_gspo(old, new, adv, m, "seq-mean-token-mean"), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_rloo_parity_every_mode(mode):
    old, new, a, m = batch(2, 0.05)
    ref = ref_rloo(old, new, a, m, mode, per_token=HAS_RATIO_GRAD)
    ours = aggregate(RLOOClip()(new, old, a, m).token_loss, m, mode).loss
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grads(ours, new), grads(ref, new), rtol=1e-5, atol=1e-9)
    loss, _ = get_policy_loss_fn("rloo")(old, new, a[:, None] * m, m, mode, None)
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grads(loss, new), grads(ref, new), rtol=1e-5, atol=1e-9)


@pytest.mark.skipif(not HAS_RATIO_GRAD, reason="RLOOClip / FSPOClip have no ratio_grad setting yet")
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_ratio_grad_passes_through(mode):
    old, new, a, m = batch(5, 0.05)
    adv = a[:, None] * m
    # rloo: the config's ratio_grad reaches RLOOClip; both forms have the same value
    for form, per_token in (("per_token", True), ("length_weighted", False)):
        ref = ref_rloo(old, new, a, m, mode, per_token=per_token)
        loss, _ = get_policy_loss_fn("rloo")(old, new, adv, m, mode, {"ratio_grad": form})
        torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(grads(loss, new), grads(ref, new), rtol=1e-5, atol=1e-9)
    # length_weighted = L_i times per_token on every unclipped token under token-mean (hand rule)
    g_pt = grads(get_policy_loss_fn("rloo")(old, new, adv, m, "token-mean", None)[0], new)
    g_lw = grads(get_policy_loss_fn("rloo")(old, new, adv, m, "token-mean", {"ratio_grad": "length_weighted"})[0], new)
    torch.testing.assert_close(g_lw, g_pt * m.sum(-1, keepdim=True), rtol=1e-5, atol=1e-9)
    # fspo: same passthrough; a bad value is the rule's ValueError naming the setting
    old, new, a, m = batch(6, 0.01)
    adv = a[:, None] * m
    for form in ("per_token", "length_weighted"):
        loss, _ = get_policy_loss_fn("fspo")(old, new, adv, m, mode, {"ratio_grad": form})
        res = FSPOClip(ratio_grad=form)(new, old, a, m)
        ref = aggregate(res.token_loss, m, mode).loss
        torch.testing.assert_close(loss, ref)
        torch.testing.assert_close(grads(loss, new), grads(ref, new))
    with pytest.raises(ValueError, match="ratio_grad"):
        get_policy_loss_fn("fspo")(old, new, adv, m, mode, {"ratio_grad": "sequence"})
    with pytest.raises(ValueError, match="ratio_grad"):
        get_policy_loss_fn("rloo")(old, new, adv, m, mode, {"ratio_grad": "sequence"})


@pytest.mark.parametrize("mode, local, global_dp2", [
    # GRPO at ratio 1 (new == old): token loss -A. Rows: A = 1 on L = 3 tokens, A = -2 on L = 1
    # (one padded column). Token losses (-1, -1, -1 | 2): sum -1, token sums (-3, 2), 4 tokens, 2 rows.
    # global_batch_info = {dp_size 2, batch_num_tokens 10, global_batch_size 5, loss_scale_factor 4}
    ("token-mean", -1 / 4, -1 / 10 * 2),
    ("token-sum", -1.0, -1.0 * 2),
    ("seq-mean-token-mean", (-1 + 2) / 2, (-1 + 2) / 5 * 2),
    ("seq-mean-token-sum", -1 / 2, -1 / 5 * 2),
    ("seq-mean-token-sum-norm", -1 / (2 * 3), -1 / (5 * 4) * 2),
])
def test_global_batch_info_hand_computed(mode, local, global_dp2):
    m = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    lp = torch.full((2, 3), -1.0)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-2.0, 0.0, 0.0]])
    fn = get_policy_loss_fn("grpo")
    assert fn(lp, lp, adv, m, mode, {"global_batch_info": {}})[0].item() == pytest.approx(local)
    info = {"dp_size": 2, "batch_num_tokens": 10, "global_batch_size": 5, "loss_scale_factor": 4}
    assert fn(lp, lp, adv, m, mode, {"global_batch_info": info})[0].item() == pytest.approx(global_dp2)
    cfg = OmegaConf.create({"global_batch_info": info})
    assert fn(lp, lp, adv, m, mode, cfg)[0].item() == pytest.approx(global_dp2)
    if mode != "token-sum":  # like verl: dp_size > 1 needs the global denominator the mode uses
        need = {"dp_size": 2, "loss_scale_factor": 4}
        if mode.startswith("seq-mean"):
            need["batch_num_tokens"] = 10
        else:
            need["global_batch_size"] = 5
        with pytest.raises(ValueError, match="required"):
            fn(lp, lp, adv, m, mode, {"global_batch_info": need})


@pytest.mark.parametrize("mode", AGG_MODES)
def test_fspo_registry_matches_module(mode):
    old, new, a, m = batch(3, 0.01)
    cfg = SimpleNamespace(c_upper=0.02, c_lower=0.025, c_dual=0.05)
    loss, metrics = get_policy_loss_fn("fspo")(old, new, a[:, None] * m, m, mode, cfg)
    res = FSPOClip(c_upper=0.02, c_lower=0.025, c_dual=0.05)(new, old, a, m)
    ref = aggregate(res.token_loss, m, mode).loss
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(grads(loss, new), grads(ref, new))
    frac = ((res.clip_upper | res.clip_lower).float() * m).sum() / m.sum()
    assert metrics["actor/pg_clipfrac"] == pytest.approx(frac.item())


def test_registry_names_and_config_forms():
    # registry.py's own names; rule files add theirs (tests/test_clip_cispo_sapo_gmpo_luspo.py checks those)
    assert {"vanilla", "grpo", "rloo", "gspo", "fspo"} <= set(POLICY_LOSSES)
    assert get_policy_loss_fn("vanilla") is get_policy_loss_fn("grpo")
    with pytest.raises(ValueError, match=r"'ppo2'.*\[" + ", ".join(repr(n) for n in sorted(POLICY_LOSSES)) + r"\]"):
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
