"""ClipFractionByLength, RolloutLengthStats and FairnessMetrics on hand-computed batches."""
import math

import pytest
import torch

from fspo.clipping.base import ClipResult
from fspo.diagnostics import (METRIC_NAME_RE, ClipFractionByLength, FairnessMetrics, LengthBins,
                              RolloutLengthStats)

BINS = LengthBins(edges=[0, 4, 8])  # [0,4), [4,8), [8,inf)
LENS = [2, 3, 5, 6, 0, 8]
ADV = torch.tensor([1.0, -2.0, -1.0, 0.5, 3.0, -4.0])


def _batch():
    """6 rows, T = 8: r0 upper on all, r1 none (a stray True on padding), r2 lower on all,
    r3 upper on 3 of 6 tokens (token-rule style), r4 L = 0, r5 dual on all (overflow bin)."""
    T = 8
    m = torch.tensor([[1] * L + [0] * (T - L) for L in LENS])
    up, lo, du = (torch.zeros(6, T, dtype=torch.bool) for _ in range(3))
    up[0, :2] = True
    up[1, 5] = True  # padding: must be ignored
    lo[2, :5] = True
    up[3, :3] = True
    du[5, :] = True
    return m, up, lo, du


def _expected_all():
    return {
        "clip/seq_frac/len_00000_00004": 0.5, "clip/tok_frac/len_00000_00004": 2 / 5,
        "clip/seq_frac_upper/len_00000_00004": 0.5, "clip/seq_frac_lower/len_00000_00004": 0.0,
        "clip/seq_frac_dual/len_00000_00004": 0.0,
        "clip/seq_frac/len_00004_00008": 0.75, "clip/tok_frac/len_00004_00008": 8 / 11,
        "clip/seq_frac_upper/len_00004_00008": 0.25, "clip/seq_frac_lower/len_00004_00008": 0.5,
        "clip/seq_frac_dual/len_00004_00008": 0.0,
        "clip/seq_frac/len_00008_inf": 1.0, "clip/tok_frac/len_00008_inf": 1.0,
        "clip/seq_frac_upper/len_00008_inf": 0.0, "clip/seq_frac_lower/len_00008_inf": 0.0,
        "clip/seq_frac_dual/len_00008_inf": 1.0,
        "clip/seq_frac": 0.7, "clip/tok_frac": 18 / 24,
        "clip/seq_frac_upper": 0.3, "clip/seq_frac_lower": 0.2, "clip/seq_frac_dual": 0.2,
        "clip/tok_frac_upper": 5 / 24, "clip/tok_frac_lower": 5 / 24, "clip/tok_frac_dual": 8 / 24,
        # q = (0.5, 0.25, 0), n = (2, 2, 1): q_bar = 0.3, LRE = 0.5 (2*2/3 + 2/6 + 1) / 5 = 4/15
        # sum|A| = (3, 1.5, 4): LRE_w = 0.5 (3*2/3 + 1.5/6 + 4) / 8.5 = 3.125/8.5
        "fairness/lre": 4 / 15, "fairness/lre_w": 3.125 / 8.5, "fairness/q_bar": 0.3, "fairness/n_bins": 3.0,
    }


def test_clip_fraction_by_hand():
    m, up, lo, du = _batch()
    metric = ClipFractionByLength(BINS)
    metric.update(torch.tensor(LENS), m, up, lo, du, ADV)
    out = metric.compute()
    assert out == pytest.approx(_expected_all(), abs=1e-12)
    assert set(out) == set(_expected_all())  # no key for the L = 0 row, no extra keys
    assert int(metric.n_seq.sum()) == 5


def test_lre_min_len_and_token_broadcast_advantages():
    m, up, lo, du = _batch()
    metric = ClipFractionByLength(BINS, lre_min_len=4)
    adv_bt = ADV[:, None].expand(-1, 8).clone()
    adv_bt[~m.bool()] = 100.0  # padding values must not enter the masked mean
    metric.update(None, m, up, lo, du, adv_bt)
    out = metric.compute()
    # bin [0,4) excluded: q = (0.25, 0), n = (2, 1), q_bar = 1/6, LRE = 0.5 (2*0.5 + 1) / 3 = 1/3
    assert out["fairness/lre"] == pytest.approx(1 / 3, abs=1e-12)
    assert out["fairness/q_bar"] == pytest.approx(1 / 6, abs=1e-12)
    # sum|A| = (1.5, 4): LRE_w = 0.5 (1.5*0.5 + 4*1) / 5.5
    assert out["fairness/lre_w"] == pytest.approx(0.5 * 4.75 / 5.5, abs=1e-12)
    assert out["clip/seq_frac"] == pytest.approx(0.7)  # overall still counts every bin


def test_k_updates_equal_one_update():
    torch.manual_seed(0)
    B, T = 300, 40
    L = torch.randint(0, T + 1, (B,))
    m = (torch.arange(T)[None] < L[:, None]).long()
    up, lo, du = (torch.rand(B, T) < p for p in (0.2, 0.1, 0.05))
    adv = torch.randn(B)
    bins = LengthBins(edges=[0, 5, 10, 20, 30])
    one, many = ClipFractionByLength(bins), ClipFractionByLength(bins)
    one.update(L, m, up, lo, du, adv)
    for sl in torch.arange(B).split(37):
        many.update(L[sl], m[sl], up[sl], lo[sl], du[sl], adv[sl])
    for name in one._defaults:
        torch.testing.assert_close(getattr(one, name), getattr(many, name), rtol=1e-13, atol=0)
    assert one.compute() == pytest.approx(many.compute(), rel=1e-12)


def test_empty_inputs_no_nan_no_crash():
    metric = ClipFractionByLength(BINS)
    empty = torch.zeros(0, 0, dtype=torch.bool)
    metric.update(torch.zeros(0, dtype=torch.long), empty.long(), empty, empty, empty, torch.zeros(0))
    assert metric.compute() == {}
    # only L = 0 rows: still nothing to report
    z = torch.zeros(3, 5, dtype=torch.bool)
    metric.update(torch.zeros(3, dtype=torch.long), z.long(), z, z, z, torch.ones(3))
    assert metric.compute() == {}
    # one row in one bin: other bins omitted, LRE = 0 (a single bin is perfectly fair)
    m = torch.tensor([[1, 1, 0, 0, 0]])
    metric.update(None, m, m.bool(), z[:1], z[:1], torch.ones(1))
    out = metric.compute()
    assert out["fairness/lre"] == 0.0 and out["clip/seq_frac/len_00000_00004"] == 1.0
    assert all(math.isfinite(v) for v in out.values())
    assert not any("len_00004_00008" in k for k in out)


def test_bad_inputs_raise_clear_errors():
    m, up, lo, du = _batch()
    metric = ClipFractionByLength(BINS)
    bad = ADV.clone()
    bad[1] = float("nan")
    with pytest.raises(ValueError, match="advantages contains NaN at 1 positions"):
        metric.update(None, m, up, lo, du, bad)
    with pytest.raises(ValueError, match="must equal response_mask.sum"):
        metric.update(torch.tensor(LENS) + 1, m, up, lo, du, ADV)
    with pytest.raises(ValueError, match="clip_lower must have shape"):
        metric.update(None, m, up, lo[:, :3], du, ADV)
    with pytest.raises(ValueError, match="advantages must have shape"):
        metric.update(None, m, up, lo, du, ADV[:3])
    with pytest.raises(ValueError, match="LengthBins"):
        ClipFractionByLength([0, 4])


def test_token_rule_gives_fractional_sequence_fractions():
    from fspo.clipping.grpo import GRPOClip

    # one sequence of 4 tokens, A > 0, token log-ratios 0, 0.5, 0, 0.5 -> ratio 1.65 > 1.28 twice
    lp = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]])
    m = torch.tensor([[1, 1, 1, 1, 0]])
    res = GRPOClip()(lp, torch.zeros_like(lp), torch.tensor([1.0]), m)
    metric = ClipFractionByLength(LengthBins(edges=[0, 10]))
    metric.update(None, m, res.clip_upper, res.clip_lower, res.clip_dual, torch.tensor([1.0]))
    out = metric.compute()
    assert out["clip/seq_frac"] == pytest.approx(0.5) and out["clip/tok_frac"] == pytest.approx(0.5)
    assert out["fairness/q_bar"] == pytest.approx(0.5)


def test_rollout_length_stats_by_hand():
    r = RolloutLengthStats()
    r.update(torch.tensor([10, 0, 30]), torch.tensor([False, False, True]))
    r.update(torch.tensor([30, 6]), torch.tensor([1, 0]))
    out = r.compute()
    assert out == pytest.approx({"rollout/overlong_rate": 0.4, "rollout/response_len_mean": 76 / 5,
                                 "rollout/response_len_mean_excl_overlong": 16 / 3,
                                 "rollout/response_len_max": 30.0, "rollout/n_responses": 5.0})
    r2 = RolloutLengthStats()
    r2.update(torch.tensor([5]), torch.tensor([True]))
    assert "rollout/response_len_mean_excl_overlong" not in r2.compute()
    with pytest.raises(ValueError, match="negative"):
        r2.update(torch.tensor([-1]), torch.tensor([False]))
    with pytest.raises(ValueError, match="overlong shape"):
        r2.update(torch.tensor([1, 2]), torch.tensor([False]))


def test_fairness_metrics_bundle():
    m, up, lo, du = _batch()
    fm = FairnessMetrics(BINS, reservoir_size=16)
    assert {"clip", "log_ratio", "rollout"} <= {n for n, _ in fm.named_children()}
    s = torch.tensor([0.1, -0.2, 0.3, 0.0, 0.0, -0.5])
    fm.update_clip(ClipResult(torch.zeros(6, 8), s, up, lo, du), torch.tensor(LENS), m, ADV)
    fm.update_rollout(torch.tensor(LENS), torch.tensor([0, 0, 0, 0, 0, 1]).bool())
    out = fm.compute()
    for k, v in _expected_all().items():
        assert out[k] == pytest.approx(v, abs=1e-12), k
    assert out["rollout/overlong_rate"] == pytest.approx(1 / 6)
    assert "logratio/sigma_hat" in out and "logratio/mean/len_00004_00008" in out
    assert all(METRIC_NAME_RE.match(k) for k in out)
    assert all(isinstance(v, float) and math.isfinite(v) for v in out.values())
    fm.reset()
    assert fm.compute() == {}
    fm.update_clip(ClipResult(torch.zeros(6, 8), s, up, lo, du), None, m, ADV)  # lengths derived
    assert fm.compute()["clip/seq_frac"] == pytest.approx(0.7)
    fm.update_clip(ClipResult(torch.zeros(6, 8), s, up, lo, du), None, m, ADV, log_ratio=False)
    out = fm.compute()
    assert out["clip/seq_frac"] == pytest.approx(0.7) and out["logratio/n"] == 5.0  # S counted once


def test_states_keep_dtype_under_module_to_dtype():
    """Lightning's precision="bf16-true" calls module.to(torch.bfloat16) on the whole LightningModule."""
    fm = FairnessMetrics(BINS, reservoir_size=16)
    dtypes = {(c, n): getattr(m, n).dtype for c, m in fm.named_children() for n in m._defaults}
    assert torch.float64 in dtypes.values()
    fm.to(torch.bfloat16)
    fm.half()
    fm.to("cpu", torch.float32)
    assert {(c, n): getattr(m, n).dtype for c, m in fm.named_children() for n in m._defaults} == dtypes
    m, up, lo, du = _batch()
    fm.update_clip(ClipResult(torch.zeros(6, 8), torch.zeros(6), up, lo, du), None, m, ADV.bfloat16())
    fm.reset()  # defaults kept their dtype too
    fm.update_clip(ClipResult(torch.zeros(6, 8), torch.zeros(6), up, lo, du), None, m, ADV)
    assert fm.compute()["fairness/lre_w"] == pytest.approx(3.125 / 8.5, abs=1e-12)
