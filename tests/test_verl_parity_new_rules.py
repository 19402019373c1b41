"""Parity of CISPO, SAPO and GMPO with verl 0.9.1 itself: its `compute_policy_loss_cispo`,
`compute_policy_loss_sapo` and `compute_policy_loss_geo_mean` against our registry's ``cispo``,
``sapo`` and ``geo_mean`` / ``gmpo``, and the clip rules as the trainer uses them (value="surrogate":
the same gradient, a value shifted to -A on-policy).

Data and tolerances as tests/test_verl_parity.py (whose functions this file uses): token log-ratios
N(0, 0.6^2) with four tokens beyond verl's +-20 clamp, per-token advantages with noise (mixed signs
inside low-|A| rows, one A = 0 row), a fully masked row; every aggregation mode and batch-info set
(local, global, dp 2). Loss and gradient w.r.t. log_prob within 1e-6 relative, and the three metrics.
LUSPO has no verl counterpart (tests/test_clip_new_rules.py pins it by hand). Skips without verl.
"""
from __future__ import annotations

import pytest
import torch

try:
    import verl
    from verl.trainer.ppo.core_algos import (
        compute_policy_loss_cispo,
        compute_policy_loss_geo_mean,
        compute_policy_loss_sapo,
    )
except ImportError as exc:  # pragma: no cover - depends on the environment
    pytest.skip(f"verl is not importable ({exc!r}); install it as .ci/run does to run the verl parity "
                "test", allow_module_level=True)
if verl.__version__ != "0.9.1":  # pragma: no cover
    pytest.skip(f"the parity test pins verl 0.9.1, found {verl.__version__}", allow_module_level=True)

from test_verl_parity import INFOS, METRICS, RTOL, abs_scale, actor_config, assert_rel, grad_of, token_batch  # noqa: E402

from fspo.clipping.cispo import CISPOClip  # noqa: E402
from fspo.clipping.gmpo import GMPOClip  # noqa: E402
from fspo.clipping.registry import get_policy_loss_fn  # noqa: E402
from fspo.clipping.sapo import SAPOClip  # noqa: E402
from fspo.losses import AGG_MODES, aggregate  # noqa: E402


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
