"""Off-policy sequence masking (fspo/rollout/off_policy_mask.py) through `RolloutCorrection`: keep_i by hand in
both forms, the length bias of the mean form and the flat masked fraction of the sqrt form on synthetic
per-token log-ratios, the per-length diagnostics, the settings' errors, and one RLModule step end to end
(a masked sequence's gradient is that of a zero advantage)."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from test_module_update import B, run_update
from test_rollout_correction import _engine_shifted

from conftest import compose_config
from fspo.rollout.correction import RolloutCorrection
from fspo.rollout.off_policy_mask import OffPolicyMask
from fspo.runtime.checks.config_check import check_config


def rows(per_token, lengths, adv, T=16):
    """behaviour log-probs = current + per_token[i] on row i's first lengths[i] tokens (current = -1)."""
    mask = (torch.arange(T) < torch.tensor(lengths)[:, None]).float()
    current = -torch.ones(len(lengths), T)
    behaviour = (current + torch.tensor(per_token)[:, None]) * mask
    return behaviour, current * mask, torch.tensor(adv), mask


def test_keep_by_hand():
    # K_i = sum_t (behaviour - current): row 0 L=4 K=1.2 (0.3/token); row 1 L=1 K=0.4; row 2 as row 0 with A > 0;
    # row 3 L=16 K=1.6 (0.1/token); row 4 L=0
    b, c, a, m = rows([0.3, 0.4, 0.3, 0.1, 0.0], [4, 1, 4, 16, 0], [-1.0, -1.0, 1.0, -1.0, -1.0])
    mean = OffPolicyMask("mean", 0.25)  # K / L > 0.25 masks: rows 0 (0.3) and 1 (0.4); row 3 (0.1) kept
    assert mean.keep(b, c, a, m).tolist() == [0, 0, 1, 1, 1]
    fair = OffPolicyMask("sqrt", 0.5)  # K > 0.5 sqrt(L): row 0 1.2 > 1.0 masked; row 1 0.4 <= 0.5; row 3 1.6 <= 2
    assert fair.keep(b, c, a, m).tolist() == [0, 1, 1, 1, 1]
    # token-level advantages: their masked mean is A_i
    assert fair.keep(b, c, a[:, None] * m, m).tolist() == [0, 1, 1, 1, 1]


def test_masked_sequence_has_zero_weight_and_alone_needs_no_recompute():
    b, c, a, m = rows([0.3, 0.0], [4, 2], [-1.0, -1.0], T=4)
    rc = RolloutCorrection(off_policy_mask="mean", off_policy_threshold=0.25, old_log_probs="engine",
                           bin_width=2, max_len=4)
    assert rc.enabled and not rc.reweights
    batch = SimpleNamespace(engine_log_probs=b, old_log_probs=None, response_mask=m, advantages=a)
    rc.fit(batch)  # nothing to fit without a mode
    w = rc.weights(batch, c)
    assert w.tolist() == [[0.0] * 4, [1.0, 1.0, 0.0, 0.0]]
    # without engine log-probs the behaviour policy is the trainer's old one (TRL's fallback)
    batch2 = SimpleNamespace(engine_log_probs=None, old_log_probs=b, response_mask=m, advantages=a)
    assert torch.equal(rc.weights(batch2, c), w)
    out = rc.compute_metrics()
    assert out["rollout_corr/opsm_frac"] == pytest.approx(0.5)
    assert out["rollout_corr/opsm_frac/len_00004_inf"] == 1.0 and out["rollout_corr/opsm_frac/len_00002_00004"] == 0.0
    assert out["rollout_corr/opsm_kl_mean/len_00004_inf"] == pytest.approx(0.3)
    with pytest.raises(ValueError, match="current log-probs"):
        rc.weights(batch)


def test_mean_form_masks_short_sequences_more_sqrt_form_is_flat():
    """d_t ~ N(0, 0.5^2), all A < 0: the mean form's K / L has std 0.5 / sqrt(L), so with delta 0.25 it masks
    P(Z > 1) = 0.159 at L = 4 and P(Z > 8) ~ 0 at L = 256; the sqrt form's K / sqrt(L) has std 0.5 at every
    L, so delta 0.5 masks P(Z > 1) = 0.159 at both (4000 sequences per length: binomial std 0.006)."""
    g = torch.Generator().manual_seed(0)
    n, T = 4000, 256
    lengths = torch.tensor([4] * n + [256] * n)
    m = (torch.arange(T) < lengths[:, None]).float()
    cur = torch.zeros(2 * n, T)
    beh = 0.5 * torch.randn(2 * n, T, generator=g) * m
    a = -torch.ones(2 * n)
    for kind, delta, want_short, want_long in (("mean", 0.25, 0.1587, 0.0), ("sqrt", 0.5, 0.1587, 0.1587)):
        masked = 1 - OffPolicyMask(kind, delta).keep(beh, cur, a, m)
        assert float(masked[:n].mean()) == pytest.approx(want_short, abs=0.025), kind
        assert float(masked[n:].mean()) == pytest.approx(want_long, abs=0.025), kind


@pytest.mark.parametrize("kw, match", [
    (dict(off_policy_mask="mean"), "off_policy_threshold must be a number > 0"),
    (dict(off_policy_mask="sqrt", off_policy_threshold=0.0), "off_policy_threshold"),
    (dict(off_policy_mask="k3", off_policy_threshold=0.1), "off_policy_mask must be one of"),
    (dict(off_policy_mask="mean", off_policy_threshold=0.1, temperature=0.7), "temperature")])
def test_bad_settings(kw, match):
    with pytest.raises(ValueError, match=match):
        RolloutCorrection(**kw)


def test_config_accepts_the_mask_with_engine_old_log_probs():
    check_config(compose_config(["rollout_correction.off_policy_mask=sqrt",
                                 "rollout_correction.off_policy_threshold=0.5"]))


def test_rlmodule_step_masked_sequence_equals_zero_advantage():
    """One SGD update of all 8 rows: row 1 (A = -1, 12 tokens) sampled by an engine 0.5 nats per token above the
    policy (K = 6, 0.5 per token > 0.25) is masked, so the gradient equals the plain step's with A_1 = 0."""
    import test_module_update as tmu

    rollout = _engine_shifted({1: -0.5})
    zero = _engine_shifted({})
    zero.advantages = zero.advantages.clone()
    zero.advantages[1] = 0.0
    orig = tmu.RLModule.__init__

    def with_mask(self, *a, **kw):
        kw["correction"] = RolloutCorrection(off_policy_mask="mean", off_policy_threshold=0.25, bin_width=4, max_len=12)
        orig(self, *a, **kw)

    tmu.RLModule.__init__ = with_mask
    try:
        _, g_mask, metrics = run_update(rollout, clip_name="grpo", sgd=True, mini_batch_size=B)
    finally:
        tmu.RLModule.__init__ = orig
    _, g_zero, _ = run_update(zero, clip_name="grpo", sgd=True, mini_batch_size=B)
    for name in g_zero[0]:
        assert torch.allclose(g_mask[0][name], g_zero[0][name], atol=1e-6, rtol=1e-4), name
    assert metrics["rollout_corr/opsm_frac"] == pytest.approx(1 / 8)
    assert metrics["rollout_corr/opsm_frac/len_00012_inf"] == pytest.approx(0.5)  # rows 1 and 5 have 12 tokens
    assert math.isfinite(metrics["rollout_corr/opsm_kl_mean/len_00012_inf"])
