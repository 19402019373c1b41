"""Train-inference mismatch correction (fspo/rollout/correction.py): each mode's weights and masks by hand,
the gradient effect (a masked sequence contributes nothing; token TIS scales a token's gradient by
min(exp(d_t), C)), the fixed cap's masked fraction rising with L while the length-fair band's stays flat
on synthetic d_t ~ N(m, s^2), the diagnostics, the config errors, and one RLModule step end to end."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from hydra.utils import instantiate
from test_module_update import B, make_rollout, run_update

from conftest import clip_config, compose_config
from fspo.losses import Aggregator
from fspo.rollout.correction import RolloutCorrection, mismatch
from fspo.runtime.checks.config_check import ConfigError, check_config


def batch_of(old, engine, mask, adv=None):
    return SimpleNamespace(old_log_probs=old, engine_log_probs=engine, response_mask=mask,
                           advantages=torch.ones(old.shape[0]) if adv is None else adv)


def two_rows():
    """Row 0: 3 tokens with d = (0.1, 1.0, -0.2); row 1: 2 tokens with d = (-0.5, -0.6), then padding."""
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    engine = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, 0.0]])
    d = torch.tensor([[0.1, 1.0, -0.2], [-0.5, -0.6, 0.0]])
    return batch_of((engine + d) * mask, engine, mask), d, mask


def corr(mode, **kw):
    kw.setdefault("bin_width", 1)
    kw.setdefault("max_len", 4)
    return RolloutCorrection(mode=mode, **kw)


def test_mismatch_is_old_minus_engine_on_the_mask():
    b, d, mask = two_rows()
    dd, s, length = mismatch(b.old_log_probs, b.engine_log_probs, mask)
    assert torch.allclose(dd.float(), d * mask, atol=1e-6)
    assert s.tolist() == pytest.approx([0.9, -1.1], abs=1e-6)
    assert length.tolist() == [3.0, 2.0]


def test_token_tis_weights():
    b, d, mask = two_rows()
    c = corr("token_tis", cap=2.0)
    c.fit(b)
    w = c.weights(b)
    want = torch.tensor([[math.exp(0.1), 2.0, math.exp(-0.2)], [math.exp(-0.5), math.exp(-0.6), 0.0]])
    assert torch.allclose(w, want, atol=1e-5)
    m = c.compute_metrics()
    assert m["rollout_corr/masked_frac"] == pytest.approx((1 / 3 + 0) / 2)  # one of row 0's 3 tokens truncated


def test_seq_is_weights():
    b, _, mask = two_rows()
    c = corr("seq_is", cap=2.0)
    c.fit(b)
    w = c.weights(b)
    want = torch.tensor([[2.0] * 3, [math.exp(-1.1)] * 2 + [0.0]])  # exp(0.9) = 2.46 -> 2; exp(-1.1) kept
    assert torch.allclose(w, want, atol=1e-5)


def test_seq_mask_is_two_sided_in_log_space():
    b, _, mask = two_rows()
    c = corr("seq_mask", cap=3.0)  # log 3 = 1.0986: |0.9| kept, |-1.1| masked
    c.fit(b)
    assert torch.equal(c.weights(b), torch.tensor([[1.0, 1, 1], [0, 0, 0]]))
    c = corr("seq_mask", cap=2.0)  # log 2 = 0.69: both masked
    c.fit(b)
    assert torch.equal(c.weights(b), torch.zeros(2, 3))


def test_fair_band_centres_on_the_drift_and_scales_with_sqrt_length():
    """m = sum S / sum L = -0.2 / 5, s^2 = mean_i (S_i - m L_i)^2 / L_i; keep row i iff
    |S_i - m L_i| <= z s sqrt(L_i)."""
    b, d, mask = two_rows()
    m = -0.2 / 5
    s = math.sqrt(((0.9 - 3 * m) ** 2 / 3 + (-1.1 - 2 * m) ** 2 / 2) / 2)  # 0.658
    c = corr("seq_fair_mask", z=1.0)
    c.fit(b)
    assert (c.m, c.s) == (pytest.approx(m), pytest.approx(s))
    u = [abs(0.9 - 3 * m) / (s * math.sqrt(3)), abs(-1.1 - 2 * m) / (s * math.sqrt(2))]  # 0.89, 1.10
    for z in (0.8, 1.0, 1.2):
        c = corr("seq_fair_mask", z=z)
        c.fit(b)
        keep = [float(x <= z) for x in u]
        assert c.weights(b)[:, 0].tolist() == keep
    c = corr("seq_fair_tis", z=1.0)
    c.fit(b)
    top = [3 * m + s * math.sqrt(3), 2 * m + s * math.sqrt(2)]
    want = [math.exp(min(0.9, top[0])), math.exp(min(-1.1, top[1]))]
    assert c.weights(b)[:, 0].tolist() == pytest.approx(want, rel=1e-5)
    assert c.weights(b)[1, 2] == 0  # padding


def test_gradient_masked_sequence_is_zero_and_token_tis_scales_by_min_ratio_cap():
    """Through a real clip rule and aggregation: the weighted loss's gradient w.r.t. logp is the weight
    times the unweighted one, token by token (the weight is detached)."""
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]])
    engine = -torch.rand(3, 4) * mask
    d = torch.tensor([[0.1, 1.2, -0.3, 0.2], [2.0, 0.5, 0.1, 0.0], [0.0, 0.05, 0.0, 0.0]])
    old = (engine + d) * mask
    adv = torch.tensor([1.0, -0.7, 0.4])
    b = batch_of(old, engine, mask, adv)
    clip = instantiate(clip_config("grpo"))
    agg = Aggregator("token-mean")

    def grad(weights=None):
        logp = (old + 0.03 * torch.randn(3, 4, generator=torch.Generator().manual_seed(1)) * mask).requires_grad_()
        tl = clip(logp, old, adv, mask).token_loss
        if weights is not None:
            tl = tl * weights
        agg(tl, mask, total_tokens=mask.sum(), total_seqs=3, norm_len=4).loss.backward()
        return logp.grad

    g0 = grad()
    c = corr("token_tis", cap=2.0)
    c.fit(b)
    w = c.weights(b)
    assert w.requires_grad is False
    assert torch.allclose(grad(w), g0 * torch.exp(d).clamp(max=2.0) * mask, atol=1e-7)
    c = corr("seq_mask", cap=2.0)  # row 1: S = 2.6 > log 2, masked; rows 0 (S = 1.2 > 0.69) masked too
    c.fit(b)
    g = grad(c.weights(b))
    assert torch.equal(g[0], torch.zeros(4)) and torch.equal(g[1], torch.zeros(4))
    assert torch.allclose(g[2], g0[2])


def synthetic(length, n, m, s, seed, width=None):
    """n sequences of ``length`` tokens, d_t ~ N(m, s^2) iid; engine log-probs arbitrary."""
    g = torch.Generator().manual_seed(seed)
    T = width or length
    mask = torch.zeros(n, T, dtype=torch.long)
    mask[:, :length] = 1
    engine = -torch.rand(n, T, generator=g, dtype=torch.float64)
    d = m + s * torch.randn(n, T, generator=g, dtype=torch.float64)
    return batch_of(((engine + d) * mask).float(), (engine * mask).float(), mask)


LENGTHS = (10, 50, 100, 200, 500, 1000, 2000)


def masked_fraction(c, b):
    c.fit(b)
    return 1.0 - float(c.weights(b)[:, 0].double().mean())


def test_fixed_cap_masks_more_with_length_while_the_fair_band_stays_flat():
    """d_t ~ N(-s^2/2, s^2), s = 0.05 (the drift of a normalised mismatch): under verl's cap 2 the masked
    fraction goes from ~0 at L = 10 to most sequences at L = 2000; the fair band (z = 2) masks
    2 Phi(-2) = 4.55% at every length."""
    s = 0.05
    fixed, fair = [], []
    for k, L in enumerate(LENGTHS):
        b = synthetic(L, 1000, -s * s / 2, s, seed=k)
        fixed.append(masked_fraction(corr("seq_mask", cap=2.0, max_len=2000, bin_width=200), b))
        fair.append(masked_fraction(corr("seq_fair_mask", z=2.0, max_len=2000, bin_width=200), b))
    target = 2 * (1 - 0.5 * (1 + math.erf(2 / math.sqrt(2))))
    assert fixed[0] < 0.01 and fixed[-1] > 0.6
    assert all(a <= b + 0.02 for a, b in zip(fixed, fixed[1:]))  # rising
    assert max(abs(f - target) for f in fair) < 0.025, fair


def test_quantile_band_is_flat_on_a_mixed_length_batch():
    """band=quantile: one batch with 400 sequences at each length; the masked fraction per length is
    2 Phi(-z) within sampling and histogram error, also for a heavy-tailed (Laplace) d_t."""
    lengths = (10, 100, 1000)
    for law in ("normal", "laplace"):
        parts = []
        for k, L in enumerate(lengths):
            b = synthetic(L, 400, 0.0, 0.05, seed=10 + k, width=max(lengths))
            if law == "laplace":  # heavy-tailed per-token mismatch, same scale
                g = torch.Generator().manual_seed(20 + k)
                u = torch.rand(400, max(lengths), generator=g) - 0.5
                dl = -0.035 * torch.sign(u) * torch.log1p(-2 * u.abs())
                b.old_log_probs = ((b.engine_log_probs + dl) * b.response_mask).float()
            parts.append(b)
        b = batch_of(*(torch.cat([getattr(p, f) for p in parts]) for f in
                       ("old_log_probs", "engine_log_probs", "response_mask")))
        c = corr("seq_fair_mask", z=1.5, band="quantile", max_len=1024, bin_width=100)
        c.fit(b)
        w = c.weights(b)[:, 0]
        target = 2 * (1 - 0.5 * (1 + math.erf(1.5 / math.sqrt(2))))  # 0.134
        for k in range(len(lengths)):
            frac = 1 - float(w[400 * k:400 * (k + 1)].mean())
            assert abs(frac - target) < 0.05, (law, lengths[k], frac)


def test_diagnostics_by_length_bin_and_lre():
    """logratio mean/std per bin are S's; masked_frac per bin; the fixed cap's LRE is far above the fair one."""
    s = 0.05
    parts = [synthetic(L, 300, 0.0, s, seed=30 + k, width=1000) for k, L in enumerate((50, 500, 1000))]
    b = batch_of(*(torch.cat([getattr(p, f) for p in parts]) for f in
                   ("old_log_probs", "engine_log_probs", "response_mask")))
    out = {}
    for mode in ("seq_mask", "seq_fair_mask"):
        c = corr(mode, cap=2.0, z=2.0, max_len=1200, bin_width=200)
        c.fit(b)
        out[mode] = c.compute_metrics()
    m = out["seq_mask"]
    assert m["rollout_corr/n_seq/len_00000_00200"] == 300
    assert m["rollout_corr/logratio_std/len_01000_01200"] == pytest.approx(s * math.sqrt(1000), rel=0.15)
    assert abs(m["rollout_corr/logratio_mean/len_00400_00600"]) < 0.2
    assert m["rollout_corr/masked_frac/len_01000_01200"] > 0.5 > m["rollout_corr/masked_frac/len_00000_00200"]
    assert m["rollout_corr/token_std"] == pytest.approx(s, rel=0.02)
    assert m["rollout_corr/lre"] > 0.15 > 0.05 > out["seq_fair_mask"]["rollout_corr/lre"]
    c = corr("seq_mask")
    # nothing seen: no per-bin keys
    assert c.compute_metrics() == {"rollout_corr/band_m": 0.0, "rollout_corr/band_s": 0.0}


def test_corrections_need_recompute_and_temperature_one():
    with pytest.raises(ValueError, match="old_log_probs=recompute.*mismatch is zero by construction"):
        RolloutCorrection(mode="seq_fair_mask", old_log_probs="engine")
    with pytest.raises(ValueError, match="temperature"):
        RolloutCorrection(mode="token_tis", temperature=0.6)
    with pytest.raises(ValueError, match="mode must be one of"):
        RolloutCorrection(mode="tis")
    with pytest.raises(ValueError, match="cap must be"):
        RolloutCorrection(mode="seq_mask", cap=1.0)
    RolloutCorrection(mode="none", old_log_probs="engine")  # off: anything goes
    # through the config check: rollout=hf defaults to engine old log-probs
    with pytest.raises(ConfigError, match="rollout_correction.mode=seq_mask needs ppo.old_log_probs=recompute"):
        check_config(compose_config(["rollout_correction.mode=seq_mask"]))
    check_config(compose_config(["rollout_correction.mode=seq_mask", "rollout.old_log_probs=recompute"]))


def _engine_shifted(rows_shift):
    """make_rollout() as a fresh rollout whose engine log-probs are the policy's own minus ``shift`` per
    token on the given rows (so d_t = +shift there, 0 elsewhere up to float noise)."""
    from fspo.models.tiny import build_tiny_model
    from fspo.update.logprobs import response_log_probs
    rollout = make_rollout()
    rollout.old_log_probs = None
    with torch.no_grad():
        lp, _ = response_log_probs(build_tiny_model(seed=0), rollout)
    shift = torch.zeros(B, 1)
    for i, v in rows_shift.items():
        shift[i] = v
    rollout.engine_log_probs = ((lp - shift) * rollout.response_mask).float()
    return rollout


def test_rlmodule_step_masked_sequence_equals_zero_advantage():
    """One SGD update (one mini-batch of all 8 rows, trainer recompute of old log-probs): with sequence 1
    (12 tokens) masked by the fixed cap (S = 12 x 0.5 = 6 > log 2), the gradient equals that of the
    uncorrected step with sequence 1's advantage set to 0; the step logs the rollout_corr/ metrics."""
    import test_module_update as tmu

    from fspo.rollout.correction import RolloutCorrection as RC

    rollout = _engine_shifted({1: 0.5})
    zero = _engine_shifted({})
    zero.advantages = zero.advantages.clone()
    zero.advantages[1] = 0.0
    orig = tmu.RLModule.__init__

    def with_correction(self, *a, **kw):
        kw["correction"] = RC(mode="seq_mask", cap=2.0, bin_width=4, max_len=12)
        orig(self, *a, **kw)

    tmu.RLModule.__init__ = with_correction
    try:
        _, g_corr, metrics = run_update(rollout, clip_name="grpo", sgd=True, mini_batch_size=B)
    finally:
        tmu.RLModule.__init__ = orig
    _, g_zero, _ = run_update(zero, clip_name="grpo", sgd=True, mini_batch_size=B)
    for n in g_zero[0]:
        assert torch.allclose(g_corr[0][n], g_zero[0][n], atol=1e-6, rtol=1e-4), n
    assert metrics["rollout_corr/masked_frac"] == pytest.approx(1 / 8)
    assert metrics["rollout_corr/masked_frac/len_00012_inf"] == pytest.approx(0.5)  # rows 1 and 5 have 12 tokens
