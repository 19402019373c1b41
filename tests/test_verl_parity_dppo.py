"""Parity of DPPO with verl 0.9.1 itself: its `compute_policy_loss_dppo_tv` / `compute_policy_loss_dppo_kl`
against our registry's ``dppo_tv`` / ``dppo_kl`` and `DPPOClip` as the trainer uses it (value="surrogate":
the same gradient, a value shifted to -A on-policy), and CPPO reducing to DPPO when its two mechanisms are off.

Data: tests/test_verl_parity.py's token batch (mixed-sign noisy advantages, an A = 0 row, a fully masked
row, four tokens beyond the +-20 clamp) with the new log-probs kept < 0 (p, q are probabilities, so the
binary KL is defined), every aggregation mode and batch-info set, rollout IS weights on and off.
Loss and gradient w.r.t. log_prob within 1e-6 relative, and the three metrics. Skips without verl.
"""
from __future__ import annotations

import pytest
import torch

try:
    import verl
    from verl.trainer.ppo.core_algos import compute_policy_loss_dppo_kl, compute_policy_loss_dppo_tv
except ImportError as exc:  # pragma: no cover - depends on the environment
    pytest.skip(f"verl is not importable ({exc!r}); install it as .ci/run does to run the verl parity "
                "test", allow_module_level=True)
if verl.__version__ != "0.9.1":  # pragma: no cover
    pytest.skip(f"the parity test pins verl 0.9.1, found {verl.__version__}", allow_module_level=True)

from test_verl_parity import INFOS, METRICS, RTOL, abs_scale, actor_config, assert_rel, grad_of, token_batch  # noqa: E402
from test_verl_parity_new_rules import rule_grad  # noqa: E402

from fspo.clipping.cppo import CPPOClip  # noqa: E402
from fspo.clipping.dppo import DPPOClip  # noqa: E402
from fspo.clipping.registry import get_policy_loss_fn  # noqa: E402
from fspo.losses import AGG_MODES  # noqa: E402

VERL = {"tv": compute_policy_loss_dppo_tv, "kl": compute_policy_loss_dppo_kl}
THRESH = {"tv": dict(clip_ratio=0.2, clip_ratio_low=0.05, clip_ratio_high=0.1, clip_ratio_c=3.0),
          "kl": dict(clip_ratio=0.02, clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=20.0)}


def prob_batch(seed):
    """token_batch with new log-probs < 0 (valid probabilities) and old ones spread over (-3, 0]."""
    old, new, adv, m = token_batch(seed)
    return old, new.clamp(max=-1e-3), adv, m


def check_metrics(ours, ref):
    assert set(ours) == set(ref) == set(METRICS)
    for k in METRICS:
        assert ours[k] == pytest.approx(ref[k], rel=RTOL, abs=1e-9), k


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
