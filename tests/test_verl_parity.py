"""Parity with verl 0.9.1 itself: its `agg_loss`, `compute_policy_loss_vanilla` and
`compute_policy_loss_gspo` against `fspo.losses.aggregate` and our registry's vanilla / grpo / gspo.

Every aggregation mode, with verl's default denominators (empty ``global_batch_info``) and with
explicit global ones (dp_size 1 and 2), on random data with padding, a fully-masked row, mixed-sign
advantages and log-ratios large enough that the upper, lower and dual clips (and the +-20 / 10
float-safety clamps) all bind. Loss, gradient w.r.t. log_prob (within 1e-6 relative) and the three
metrics. verl is an optional test dependency (installed by .ci/run); without it this module skips.
"""
from __future__ import annotations

import pytest
import torch

try:
    import verl
    from verl.trainer.ppo.core_algos import agg_loss, compute_policy_loss_gspo, compute_policy_loss_vanilla
    from verl.workers.config import ActorConfig
except ImportError as exc:  # pragma: no cover - depends on the environment
    pytest.skip(f"verl is not importable ({exc!r}); install it as .ci/run does to run the verl parity "
                "test", allow_module_level=True)
if verl.__version__ != "0.9.1":  # pragma: no cover
    pytest.skip(f"the parity test pins verl 0.9.1, found {verl.__version__}", allow_module_level=True)

from fspo.clipping import GRPOClip, GSPOClip  # noqa: E402
from fspo.clipping.registry import get_policy_loss_fn  # noqa: E402
from fspo.losses import AGG_MODES, aggregate  # noqa: E402

RTOL = 1e-6
INFOS = {
    "local": {},  # verl's default: the call's own denominators, dp_size 1
    "global": {"dp_size": 1, "batch_num_tokens": 900, "global_batch_size": 40, "loss_scale_factor": 64},
    "dp2": {"dp_size": 2, "batch_num_tokens": 1800, "global_batch_size": 80, "loss_scale_factor": 48},
}
METRICS = ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower")


def actor_config(info, **clip):
    """A real verl ActorConfig (strategy / rollout_n / micro-batch size are required fields)."""
    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
                       global_batch_info=dict(info), **clip)


def assert_rel(ours, ref, what, scale=None):
    """|ours - ref| <= RTOL * scale elementwise; ``scale`` defaults to max|ref|. A loss is a sum of
    mixed-sign terms: its scale is the same aggregation of the terms' absolute values (`abs_scale`),
    so float32 cancellation in the sum does not count as a difference."""
    ours, ref = ours.detach().double(), ref.detach().double()
    assert ours.shape == ref.shape, what
    scale = ref.abs().max() if scale is None else torch.as_tensor(scale).double()
    scale = torch.maximum(scale, ref.abs().max()).clamp(min=1e-30)
    err = (ours - ref).abs().max()
    assert err <= RTOL * scale, f"{what}: max abs diff {err.item():.3e} vs scale {scale.item():.3e}"


def abs_scale(token_loss, m, mode, info):
    """verl's aggregation of |token_loss|: the magnitude a loss value is relative to."""
    return agg_loss(loss_mat=token_loss.detach().abs(), loss_mask=m, loss_agg_mode=mode, **info)


def grad_of(fn, new):
    """(loss, metrics, d loss / d new) with a fresh leaf copy of ``new``."""
    x = new.detach().clone().requires_grad_(True)
    loss, metrics = fn(x)
    (g,) = torch.autograd.grad(loss, x)
    return loss, metrics, g


def mask_from(lengths, T):
    return (torch.arange(T) < lengths[:, None]).float()


def token_batch(seed, B=16, T=40):
    """Token-level log-ratios N(0, 0.6^2) and four +-25 tokens beyond verl's +-20 clamp;
    per-token advantages A_i + noise, one row with A = 0, row 1 fully masked."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0], lengths[1] = T, 0
    m = mask_from(lengths, T)
    old = -torch.rand(B, T, generator=g) * 3
    new = old + torch.randn(B, T, generator=g) * 0.6
    new[0, :4] = old[0, :4] + torch.tensor([25.0, -25.0, 22.0, -21.0])
    a_seq = torch.randn(B, generator=g)
    a_seq[0], a_seq[2] = -1.0, 0.0
    adv = (a_seq[:, None] + 0.1 * torch.randn(B, T, generator=g)) * m
    adv[2] = 0.0
    return old, new, adv, m


def seq_batch(seed, B=16, T=40):
    """Per-row mean log-ratio S_i / L_i uniform in [-8e-4, 8e-4] around GSPO's band [-3e-4, 4e-4]
    (per-token noise with zero row mean), rows 3 / 4 clipped above / below; row 2 at 12 (beyond verl's
    clamp at 10, A < 0 so no clip binds), row 1 fully masked."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0], lengths[1] = T, 0
    m = mask_from(lengths, T)
    old = -torch.rand(B, T, generator=g) * 3
    noise = torch.randn(B, T, generator=g) * 0.2 * m
    noise = noise - (noise.sum(-1) / lengths.clamp(min=1))[:, None] * m
    shift = (torch.rand(B, generator=g) * 2 - 1) * 8e-4
    shift[2:6] = torch.tensor([12.0, 6e-4, -6e-4, 6e-4])
    new = old + shift[:, None] + noise
    a_seq = torch.randn(B, generator=g)
    a_seq[2:6] = torch.tensor([-1.0, 0.5, -0.5, -0.5])  # rows 3, 4: upper, lower clip; row 5: not
    adv = a_seq[:, None] * m
    return old, new, adv, m


# ---- agg_loss -----------------------------------------------------------------------------------
def test_modes_are_verls():
    for mode in AGG_MODES:  # ActorConfig validates loss_agg_mode against verl's list of five
        assert actor_config({}, loss_agg_mode=mode).loss_agg_mode == mode
    assert len(AGG_MODES) == 5


@pytest.mark.parametrize("info", list(INFOS))
@pytest.mark.parametrize("mode", AGG_MODES)
def test_agg_loss(mode, info):
    g = torch.Generator().manual_seed(7)
    B, T = 12, 30
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[3] = 0
    m = mask_from(lengths, T)
    mat = torch.randn(B, T, generator=g) + torch.where(m.bool(), 0.0, 1e3)  # finite padding garbage
    kw = INFOS[info]

    def verl_fn(x):
        return agg_loss(loss_mat=x, loss_mask=m, loss_agg_mode=mode, **kw), None

    def ours_fn(x):
        out = aggregate(x, m, mode, total_tokens=kw.get("batch_num_tokens"),
                        total_seqs=kw.get("global_batch_size"), norm_len=kw.get("loss_scale_factor"))
        return out.loss * kw.get("dp_size", 1), None

    ref, _, g_ref = grad_of(verl_fn, mat)
    ours, _, g_ours = grad_of(ours_fn, mat)
    assert_rel(ours, ref, f"agg_loss {mode} {info}", abs_scale(mat, m, mode, kw))
    assert_rel(g_ours, g_ref, f"agg_loss grad {mode} {info}")
    assert g_ours[m == 0].abs().sum() == 0


# ---- policy losses ------------------------------------------------------------------------------
VANILLA_CLIPS = {
    "paper": dict(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0),
    "fallback": dict(clip_ratio=0.25, clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=2.5),
}


@pytest.mark.parametrize("clips", list(VANILLA_CLIPS))
@pytest.mark.parametrize("info", list(INFOS))
@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("name", ["vanilla", "grpo"])
def test_vanilla(name, mode, info, clips):
    old, new, adv, m = token_batch(0)
    kw = VANILLA_CLIPS[clips]
    ref, ref_metrics, g_ref = grad_of(
        lambda x: compute_policy_loss_vanilla(old, x, adv, m, mode, actor_config(INFOS[info], **kw)), new)
    ours, metrics, g_ours = grad_of(
        lambda x: get_policy_loss_fn(name)(old, x, adv, m, mode, actor_config(INFOS[info], **kw)), new)
    low = kw["clip_ratio_low"] or kw["clip_ratio"]
    high = kw["clip_ratio_high"] or kw["clip_ratio"]
    res = GRPOClip(low, high, kw["clip_ratio_c"])(new, old, adv, m)
    assert_rel(ours, ref, f"{name} loss", abs_scale(res.token_loss, m, mode, INFOS[info]))
    assert_rel(g_ours, g_ref, f"{name} grad")
    assert set(metrics) == set(ref_metrics) == set(METRICS)
    for k in METRICS:
        assert metrics[k] == pytest.approx(ref_metrics[k], rel=RTOL, abs=1e-9), k
    # the data exercises every branch: upper, lower, dual clip and the +-20 clamp all occur
    assert res.clip_upper.any() and res.clip_lower.any() and res.clip_dual.any()
    assert ((new - old).abs()[m.bool()] > 20).any()
    assert 0 < ref_metrics["actor/pg_clipfrac"] < 1 and 0 < ref_metrics["actor/pg_clipfrac_lower"] < 1


@pytest.mark.parametrize("info", list(INFOS))
@pytest.mark.parametrize("mode", AGG_MODES)
def test_gspo(mode, info):
    old, new, adv, m = seq_batch(1)
    kw = dict(clip_ratio=3e-4, clip_ratio_low=3e-4, clip_ratio_high=4e-4)
    ref, ref_metrics, g_ref = grad_of(
        lambda x: compute_policy_loss_gspo(old, x, adv, m, mode, actor_config(INFOS[info], **kw)), new)
    ours, metrics, g_ours = grad_of(
        lambda x: get_policy_loss_fn("gspo")(old, x, adv, m, mode, actor_config(INFOS[info], **kw)), new)
    res = GSPOClip(3e-4, 4e-4)(new, old, adv, m)
    assert_rel(ours, ref, "gspo loss", abs_scale(res.token_loss, m, mode, INFOS[info]))
    assert_rel(g_ours, g_ref, "gspo grad")
    for k in METRICS:
        assert metrics[k] == pytest.approx(ref_metrics[k], rel=RTOL, abs=1e-9), k
    assert res.clip_upper.any() and res.clip_lower.any() and not res.clipped[m.bool()].all()
    assert ref_metrics["actor/pg_clipfrac_lower"] == 0.0 and 0 < ref_metrics["actor/pg_clipfrac"] < 1


def test_gspo_default_mode_is_verls():
    old, new, adv, m = seq_batch(2)
    cfg = actor_config({}, clip_ratio=3e-4, clip_ratio_low=3e-4, clip_ratio_high=4e-4)
    ref, _ = compute_policy_loss_gspo(old, new, adv, m, config=cfg)
    ours, _ = get_policy_loss_fn("gspo")(old, new, adv, m, config=cfg)
    assert_rel(ours, ref, "gspo default mode")
    assert_rel(ours, get_policy_loss_fn("gspo")(old, new, adv, m, "seq-mean-token-mean", cfg)[0], "default")


def test_dp_size_needs_global_denominators_like_verl():
    old, new, adv, m = token_batch(3)
    cfg = actor_config({"dp_size": 2})
    for mode in ("token-mean", "seq-mean-token-mean"):
        with pytest.raises(ValueError, match="required"):
            compute_policy_loss_vanilla(old, new, adv, m, mode, cfg)
        with pytest.raises(ValueError, match="required"):
            get_policy_loss_fn("vanilla")(old, new, adv, m, mode, cfg)
    ref, _ = compute_policy_loss_vanilla(old, new, adv, m, "token-sum", cfg)
    assert_rel(get_policy_loss_fn("vanilla")(old, new, adv, m, "token-sum", cfg)[0], ref, "token-sum dp2")
