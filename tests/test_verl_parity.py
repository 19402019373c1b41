"""Parity with verl 0.9.1 itself, loss by loss: verl's `agg_loss` and policy losses against
`fspo.losses.aggregate` and the registry's rules of the same name.

- aggregation: every mode, with verl's default denominators (empty ``global_batch_info``) and with explicit
  global ones (dp_size 1 and 2);
- vanilla / grpo / gspo: `compute_policy_loss_vanilla` and `compute_policy_loss_gspo`, on random data with
  padding, a fully-masked row, mixed-sign advantages and log-ratios large enough that the upper, lower and
  dual clips (and the +-20 / 10 float-safety clamps) all bind;
- CISPO, SAPO and GMPO: `compute_policy_loss_cispo`, `compute_policy_loss_sapo` and
  `compute_policy_loss_geo_mean` against ``cispo``, ``sapo`` and ``geo_mean`` / ``gmpo``, and the clip rules as
  the trainer uses them (value="surrogate": the same gradient, a value shifted to -A on-policy); token
  log-ratios N(0, 0.6^2) with four tokens beyond verl's +-20 clamp, per-token advantages with noise (mixed
  signs inside low-|A| rows, one A = 0 row), a fully masked row. LUSPO has no verl counterpart
  (tests/test_clip_cispo_sapo_gmpo_luspo.py pins it by hand);
- DPPO: `compute_policy_loss_dppo_tv` / `compute_policy_loss_dppo_kl` against ``dppo_tv`` / ``dppo_kl`` and
  `DPPOClip` as the trainer uses it, with the new log-probs kept < 0 (p, q are probabilities, so the binary
  KL is defined), rollout IS weights on and off; and CPPO reducing to DPPO when its two mechanisms are off.
Loss, gradient w.r.t. log_prob (within 1e-6 relative) and the three metrics, for every aggregation mode and
batch-info set (local, global, dp 2). verl is an optional test dependency (installed by .ci/run); without it
this module skips.
"""
from __future__ import annotations

import pytest
import torch

try:
    import verl
    from verl.trainer.ppo.core_algos import (
        agg_loss,
        compute_policy_loss_cispo,
        compute_policy_loss_dppo_kl,
        compute_policy_loss_dppo_tv,
        compute_policy_loss_geo_mean,
        compute_policy_loss_gspo,
        compute_policy_loss_sapo,
        compute_policy_loss_vanilla,
    )
    from verl.workers.config import ActorConfig
except ImportError as exc:  # pragma: no cover - depends on the environment
    pytest.skip(f"verl is not importable ({exc!r}); install it as .ci/run does to run the verl parity "
                "test", allow_module_level=True)
if verl.__version__ != "0.9.1":  # pragma: no cover
    pytest.skip(f"the parity test pins verl 0.9.1, found {verl.__version__}", allow_module_level=True)

from fspo.clipping import GRPOClip, GSPOClip  # noqa: E402
from fspo.clipping.cispo import CISPOClip  # noqa: E402
from fspo.clipping.cppo import CPPOClip  # noqa: E402
from fspo.clipping.dppo import DPPOClip  # noqa: E402
from fspo.clipping.gmpo import GMPOClip  # noqa: E402
from fspo.clipping.registry import get_policy_loss_fn  # noqa: E402
from fspo.clipping.sapo import SAPOClip  # noqa: E402
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


# ============================== CISPO, SAPO, GMPO
def check_metrics(ours, ref):
    assert set(ours) == set(ref) == set(METRICS)
    for k in METRICS:
        assert ours[k] == pytest.approx(ref[k], rel=RTOL, abs=1e-9), k


def rule_grad(rule, old, new, adv, m, mode, info):
    """The gradient the trainer takes: the rule (its default value form) + `aggregate` (+ dp factor)."""
    def fn(x):
        res = rule(x, old, adv, m)
        out = aggregate(res.token_loss, m, mode, total_tokens=info.get("batch_num_tokens"),
                        total_seqs=info.get("global_batch_size"), norm_len=info.get("loss_scale_factor"))
        return out.loss * info.get("dp_size", 1), None
    return grad_of(fn, new)[2]


# ---- CISPO ----------------------------------------------------------------------------------------
CISPO_CLIPS = {"paper": dict(clip_ratio=0.2, clip_ratio_low=1.0, clip_ratio_high=0.28),
               "two-sided": dict(clip_ratio=0.25, clip_ratio_low=None, clip_ratio_high=None)}


@pytest.mark.parametrize("clips", list(CISPO_CLIPS))
@pytest.mark.parametrize("info", list(INFOS))
@pytest.mark.parametrize("mode", AGG_MODES)
def test_cispo(mode, info, clips):
    old, new, adv, m = token_batch(0)
    kw = CISPO_CLIPS[clips]
    cfg = actor_config(INFOS[info], **kw)
    ref, ref_metrics, g_ref = grad_of(lambda x: compute_policy_loss_cispo(old, x, adv, m, mode, cfg), new)
    ours, metrics, g_ours = grad_of(lambda x: get_policy_loss_fn("cispo")(old, x, adv, m, mode, cfg), new)
    low, high = kw["clip_ratio_low"] or kw["clip_ratio"], kw["clip_ratio_high"] or kw["clip_ratio"]
    res = CISPOClip(low, high, value="verl")(new, old, adv, m)
    assert_rel(ours, ref, "cispo loss", abs_scale(res.token_loss, m, mode, INFOS[info]))
    assert_rel(g_ours, g_ref, "cispo grad")
    check_metrics(metrics, ref_metrics)
    assert_rel(rule_grad(CISPOClip(low, high), old, new, adv, m, mode, INFOS[info]), g_ref, "cispo surrogate grad")
    # the data exercises the cap (and, two-sided, the floor) and the +-20 clamp
    assert res.clip_upper.any() and (res.clip_lower.any() == (clips == "two-sided"))
    assert 0 < ref_metrics["actor/pg_clipfrac"] < 1


# ---- SAPO -----------------------------------------------------------------------------------------
SAPO_TAUS = {"paper": dict(tau_pos=1.0, tau_neg=1.05), "sharp": dict(tau_pos=3.0, tau_neg=8.0)}


@pytest.mark.parametrize("taus", list(SAPO_TAUS))
@pytest.mark.parametrize("info", list(INFOS))
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_sapo(mode, info, taus):
    """verl's sapo aggregates with seq-mean-token-mean whatever ``loss_agg_mode`` says; so does ours."""
    old, new, adv, m = token_batch(1)
    cfg = actor_config(INFOS[info], **SAPO_TAUS[taus])
    ref, ref_metrics, g_ref = grad_of(lambda x: compute_policy_loss_sapo(old, x, adv, m, mode, cfg), new)
    ours, metrics, g_ours = grad_of(lambda x: get_policy_loss_fn("sapo")(old, x, adv, m, mode, cfg), new)
    res = SAPOClip(**SAPO_TAUS[taus], value="verl")(new, old, adv, m)
    assert_rel(ours, ref, "sapo loss", abs_scale(res.token_loss, m, "seq-mean-token-mean", INFOS[info]))
    assert_rel(g_ours, g_ref, "sapo grad")
    check_metrics(metrics, ref_metrics)
    g_rule = rule_grad(SAPOClip(**SAPO_TAUS[taus]), old, new, adv, m, "seq-mean-token-mean", INFOS[info])
    assert_rel(g_rule, g_ref, "sapo surrogate grad")
    assert res.clip_upper.any() and not res.clipped[m.bool()].all()
    assert res.clip_lower.any() == (taus == "sharp")  # below r = 1 only for tau > 1.7627


def test_sapo_default_taus_are_verls():
    old, new, adv, m = token_batch(2)
    cfg = actor_config({})
    ref, _ = compute_policy_loss_sapo(old, new, adv, m, config=cfg)
    assert_rel(get_policy_loss_fn("sapo")(old, new, adv, m, config=cfg)[0], ref, "sapo defaults")
    assert get_policy_loss_fn("sapo")(old, new, adv, m, config=None)[0] == pytest.approx(float(ref), rel=1e-6)


# ---- GMPO (verl geo_mean) -------------------------------------------------------------------------
GMPO_CLIPS = {"paper": dict(clip_ratio=0.4, clip_ratio_low=0.4, clip_ratio_high=0.4),
              "asym": dict(clip_ratio=0.3, clip_ratio_low=None, clip_ratio_high=0.5)}


@pytest.mark.parametrize("name", ["geo_mean", "gmpo"])
@pytest.mark.parametrize("clips", list(GMPO_CLIPS))
@pytest.mark.parametrize("info", list(INFOS))
def test_geo_mean(info, clips, name):
    """verl's geo_mean ignores loss_agg_mode and global_batch_info (a plain mean over the B rows)."""
    old, new, adv, m = token_batch(3)
    adv[3] = torch.linspace(-0.5, 0.5, adv.shape[1]) * m[3]  # a row whose token advantages change sign
    kw = GMPO_CLIPS[clips]
    cfg = actor_config(INFOS[info], **kw)
    ref, ref_metrics, g_ref = grad_of(lambda x: compute_policy_loss_geo_mean(old, x, adv, m, "token-mean", cfg), new)
    for mode in AGG_MODES:
        ours, metrics, g_ours = grad_of(lambda x, mode=mode: get_policy_loss_fn(name)(old, x, adv, m, mode, cfg), new)
        assert_rel(ours, ref, f"{name} loss {mode}")
        assert_rel(g_ours, g_ref, f"{name} grad {mode}")
        check_metrics(metrics, ref_metrics)
    low, high = kw["clip_ratio_low"] or kw["clip_ratio"], kw["clip_ratio_high"] or kw["clip_ratio"]
    res = GMPOClip(low, high)(new, old, adv, m)
    # the trainer's form: the rule under seq-mean-token-mean over the B rows gives verl's gradient
    assert_rel(rule_grad(GMPOClip(low, high), old, new, adv, m, "seq-mean-token-mean",
                         {"global_batch_size": m.shape[0]}), g_ref, "gmpo rule grad")
    assert res.clip_upper.any() and res.clip_lower.any() and not res.clipped[m.bool()].all()
    assert ((new - old).abs()[m.bool()] > 20).any()



@pytest.mark.parametrize("name", ["geo_mean", "gmpo"])
def test_geo_mean_rollout_is_weights(name):
    """verl's geo_mean weighs each sequence by the geometric mean of its tokens' rollout_is_weights."""
    old, new, adv, m = token_batch(3)
    w = torch.exp(0.3 * torch.randn(m.shape, generator=torch.Generator().manual_seed(5)))
    cfg = actor_config(INFOS["local"], **GMPO_CLIPS["paper"])
    ref, ref_metrics, g_ref = grad_of(
        lambda x: compute_policy_loss_geo_mean(old, x, adv, m, "token-mean", cfg, rollout_is_weights=w), new)
    ours, metrics, g_ours = grad_of(
        lambda x: get_policy_loss_fn(name)(old, x, adv, m, "token-mean", cfg, rollout_is_weights=w), new)
    plain, _, _ = grad_of(lambda x: get_policy_loss_fn(name)(old, x, adv, m, "token-mean", cfg), new)
    assert_rel(ours, ref, f"{name} weighted loss")
    assert_rel(g_ours, g_ref, f"{name} weighted grad")
    check_metrics(metrics, ref_metrics)
    assert abs(float(ours) - float(plain)) > 1e-3 * abs(float(plain))  # the weights change the loss

# ============================== DPPO, CPPO
VERL = {"tv": compute_policy_loss_dppo_tv, "kl": compute_policy_loss_dppo_kl}
THRESH = {"tv": dict(clip_ratio=0.2, clip_ratio_low=0.05, clip_ratio_high=0.1, clip_ratio_c=3.0),
          "kl": dict(clip_ratio=0.02, clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=20.0)}


def prob_batch(seed):
    """token_batch with new log-probs < 0 (valid probabilities) and old ones spread over (-3, 0]."""
    old, new, adv, m = token_batch(seed)
    return old, new.clamp(max=-1e-3), adv, m


@pytest.mark.parametrize("is_weights", [False, True])
@pytest.mark.parametrize("kind", ["tv", "kl"])
@pytest.mark.parametrize("info", list(INFOS))
@pytest.mark.parametrize("mode", AGG_MODES)
def test_dppo(mode, info, kind, is_weights):
    old, new, adv, m = prob_batch(4)
    w = (0.5 + torch.rand(old.shape, generator=torch.Generator().manual_seed(9))) if is_weights else None
    cfg = actor_config(INFOS[info], **THRESH[kind])
    ref, ref_metrics, g_ref = grad_of(lambda x: VERL[kind](old, x, adv, m, mode, cfg, rollout_is_weights=w), new)
    ours, metrics, g_ours = grad_of(
        lambda x: get_policy_loss_fn(f"dppo_{kind}")(old, x, adv, m, mode, cfg, rollout_is_weights=w), new)
    t = THRESH[kind]
    low, high = t["clip_ratio_low"] or t["clip_ratio"], t["clip_ratio_high"] or t["clip_ratio"]
    res = DPPOClip(kind, low, high, t["clip_ratio_c"], value="verl")(new, old, adv, m)
    scale_loss = res.token_loss if w is None else res.token_loss * w
    assert_rel(ours, ref, "dppo loss", abs_scale(scale_loss, m, mode, INFOS[info]))
    assert_rel(g_ours, g_ref, "dppo grad")
    check_metrics(metrics, ref_metrics)
    if w is None:
        g_rule = rule_grad(DPPOClip(kind, low, high, t["clip_ratio_c"]), old, new, adv, m, mode, INFOS[info])
        assert_rel(g_rule, g_ref, "dppo surrogate grad")
        # CPPO with both mechanisms off is DPPO
        g_cppo = rule_grad(CPPOClip(kind, low, high, w_min=1.0, budget="none", clip_ratio_c=t["clip_ratio_c"]),
                           old, new, adv, m, mode, INFOS[info])
        assert_rel(g_cppo, g_ref, "cppo (off) grad")
    # the data masks tokens on both sides and leaves most in
    assert res.clip_upper.any() and res.clip_lower.any() and not res.clipped[m.bool()].all()
    assert 0 < ref_metrics["actor/pg_clipfrac"] < 1


def test_dppo_default_truncation_is_verls():
    """A config without clip_ratio_c: verl reads 20; a verl ActorConfig carries its own 3.0 (and its
    clip_ratio_low / clip_ratio_high default to 0.2, so its clip_ratio is not read for DPPO)."""
    old, new, adv, m = prob_batch(5)
    cfg = actor_config({}, clip_ratio=0.1)
    ref, _ = compute_policy_loss_dppo_tv(old, new, adv, m, config=cfg)
    assert_rel(get_policy_loss_fn("dppo_tv")(old, new, adv, m, config=cfg)[0], ref, "dppo defaults")
    plain = get_policy_loss_fn("dppo_tv")(old, new, adv, m, config={"clip_ratio": 0.2})[0]
    ref20, _ = compute_policy_loss_dppo_tv(old, new, adv, m, config=actor_config({}, clip_ratio_c=20.0))
    assert_rel(plain, ref20, "dppo C=20 when absent")
