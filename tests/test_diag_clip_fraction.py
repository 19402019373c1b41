"""ClipFractionByLength, RolloutLengthStats and FairnessMetrics on hand-computed batches."""
import math

import pytest
import torch

from fspo.clipping.base import ClipResult
from fspo.diagnostics import METRIC_NAME_RE, ClipFractionByLength, FairnessMetrics, LengthBins, RolloutLengthStats

BINS = LengthBins(edges=[0, 4, 8])  # [0,4), [4,8), [8,inf)
LENS = [2, 3, 5, 6, 0, 8]
ADV = torch.tensor([1.0, -2.0, -1.0, 0.5, 3.0, -4.0])


def _batch():
    """6 rows, T = 8: r0 upper on all, r1 none (a stray True on padding), r2 lower on all,
    r3 upper on 3 of 6 tokens (token-rule style), r4 L = 0, r5 dual on all (overflow bin).
    ``_in_band()``: in band exactly where no clip binds (r1, r3's last 3 tokens)."""
    T = 8
    m = torch.tensor([[1] * L + [0] * (T - L) for L in LENS])
    up, lo, du = (torch.zeros(6, T, dtype=torch.bool) for _ in range(3))
    up[0, :2] = True
    up[1, 5] = True  # padding: must be ignored
    lo[2, :5] = True
    up[3, :3] = True
    du[5, :] = True
    return m, up, lo, du


def _in_band():
    ib = torch.zeros(6, 8, dtype=torch.bool)
    ib[1, :] = True  # r1 in band; True on padding too: must be ignored
    ib[3, 3:6] = True
    ib[4, :] = True  # L = 0: in no bin
    return ib


def _res(s, up, lo, du, in_band=None, cap=None):
    return ClipResult(torch.zeros(up.shape), s, up, lo, du, _in_band() if in_band is None else in_band, cap)


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
        "clip/seq_frac_cap/len_00000_00004": 0.0, "clip/seq_frac_cap/len_00004_00008": 0.0,
        "clip/seq_frac_cap/len_00008_inf": 0.0,
        "clip/seq_frac": 0.7, "clip/tok_frac": 18 / 24,
        "clip/seq_frac_upper": 0.3, "clip/seq_frac_lower": 0.2, "clip/seq_frac_dual": 0.2,
        "clip/tok_frac_upper": 5 / 24, "clip/tok_frac_lower": 5 / 24, "clip/tok_frac_dual": 8 / 24,
        "clip/seq_frac_cap": 0.0, "clip/tok_frac_cap": 0.0,
        # q = (0.5, 0.25, 0), n = (2, 2, 1): q_bar = 0.3, LRE = 0.5 (2*2/3 + 2/6 + 1) / 5 = 4/15
        # sum|A| = (3, 1.5, 4): LRE_w = 0.5 (3*2/3 + 1.5/6 + 4) / 8.5 = 3.125/8.5
        "fairness/binding_lre": 4 / 15, "fairness/binding_lre_w": 3.125 / 8.5, "fairness/binding_q_bar": 0.3,
        "fairness/binding_n_bins": 3.0,
    }


def _expected_band():
    """``_in_band()`` is the complement of the binding clips here, so q and the LRE are the same."""
    return {
        "band/out_frac/len_00000_00004": 0.5, "band/out_frac/len_00004_00008": 0.75,
        "band/out_frac/len_00008_inf": 1.0,
        "band/n_seq/len_00000_00004": 2.0, "band/n_seq/len_00004_00008": 2.0, "band/n_seq/len_00008_inf": 1.0,
        "band/out_frac": 0.7, "band/tok_out_frac": 18 / 24, "band/n_seq": 5.0,
        "fairness/lre": 4 / 15, "fairness/lre_w": 3.125 / 8.5, "fairness/q_bar": 0.3, "fairness/n_bins": 3.0,
    }


def test_clip_fraction_by_hand():
    m, up, lo, du = _batch()
    metric = ClipFractionByLength(BINS)
    metric.update(torch.tensor(LENS), m, up, lo, du, ADV)  # no in_band: binding clips only
    out = metric.compute()
    assert out == pytest.approx(_expected_all(), abs=1e-12)
    assert set(out) == set(_expected_all())  # no key for the L = 0 row, no extra keys
    assert int(metric.n_seq.sum()) == 5
    metric.update(torch.tensor(LENS), m, up, lo, du, ADV, in_band=_in_band(), acceptance=False)
    assert not any(k.startswith(("band/", "fairness/lre", "fairness/q_bar")) for k in metric.compute())
    metric.reset()
    metric.update(torch.tensor(LENS), m, up, lo, du, ADV, in_band=_in_band())
    out = metric.compute()
    want = {**_expected_all(), **_expected_band()}
    assert out == pytest.approx(want, abs=1e-12) and set(out) == set(want)


def test_lre_min_len_and_token_broadcast_advantages():
    m, up, lo, du = _batch()
    metric = ClipFractionByLength(BINS, lre_min_len=4)
    adv_bt = ADV[:, None].expand(-1, 8).clone()
    adv_bt[~m.bool()] = 100.0  # padding values must not enter the masked mean
    metric.update(None, m, up, lo, du, adv_bt, in_band=_in_band())
    out = metric.compute()
    # bin [0,4) excluded: q = (0.25, 0), n = (2, 1), q_bar = 1/6, LRE = 0.5 (2*0.5 + 1) / 3 = 1/3
    for pre in ("fairness/", "fairness/binding_"):
        assert out[pre + "lre"] == pytest.approx(1 / 3, abs=1e-12)
        assert out[pre + "q_bar"] == pytest.approx(1 / 6, abs=1e-12)
        # sum|A| = (1.5, 4): LRE_w = 0.5 (1.5*0.5 + 4*1) / 5.5
        assert out[pre + "lre_w"] == pytest.approx(0.5 * 4.75 / 5.5, abs=1e-12)
        assert out[pre + "n_bins"] == 2.0
    assert out["clip/seq_frac"] == pytest.approx(0.7)  # overall still counts every bin
    assert out["band/out_frac"] == pytest.approx(0.7)


def test_k_updates_equal_one_update():
    torch.manual_seed(0)
    B, T = 300, 40
    L = torch.randint(0, T + 1, (B,))
    m = (torch.arange(T)[None] < L[:, None]).long()
    up, lo, du, ib, cap = (torch.rand(B, T) < p for p in (0.2, 0.1, 0.05, 0.7, 0.02))
    adv = torch.randn(B)
    bins = LengthBins(edges=[0, 5, 10, 20, 30])
    one, many = ClipFractionByLength(bins), ClipFractionByLength(bins)
    one.update(L, m, up, lo, du, adv, in_band=ib, clip_cap=cap)
    for sl in torch.arange(B).split(37):
        many.update(L[sl], m[sl], up[sl], lo[sl], du[sl], adv[sl], in_band=ib[sl], clip_cap=cap[sl])
    assert 0 < float(one.band_in.sum()) < int(one.band_n_seq.sum()) and int(one.tok_cap.sum()) > 0
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
    metric.update(None, m, m.bool(), z[:1], z[:1], torch.ones(1), in_band=z[:1])
    out = metric.compute()
    assert out["fairness/lre"] == 0.0 and out["clip/seq_frac/len_00000_00004"] == 1.0
    assert out["fairness/binding_lre"] == 0.0 and out["band/out_frac/len_00000_00004"] == 1.0
    assert out["fairness/q_bar"] == 0.0  # everything out of band: q_bar = 0, LRE := 0
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
    with pytest.raises(ValueError, match="in_band must have shape"):
        metric.update(None, m, up, lo, du, ADV, in_band=up[:3])
    with pytest.raises(ValueError, match="clip_cap must have shape"):
        metric.update(None, m, up, lo, du, ADV, clip_cap=up[:, :2])
    with pytest.raises(ValueError, match="advantages must have shape"):
        metric.update(None, m, up, lo, du, ADV[:3])
    with pytest.raises(ValueError, match="LengthBins"):
        ClipFractionByLength([0, 4])


def test_token_rule_gives_fractional_sequence_fractions():
    from fspo.clipping.grpo import GRPOClip

    # one sequence of 4 tokens, A > 0, token log-ratios 0, 0.5, 0, 0.5 -> ratio 1.65 > 1.28 twice;
    # with A < 0 the same tokens are out of band but no clip binds (the min keeps the unclipped term)
    lp = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]])
    m = torch.tensor([[1, 1, 1, 1, 0]])
    for a, binding in ((1.0, 0.5), (-1.0, 0.0)):
        res = GRPOClip()(lp, torch.zeros_like(lp), torch.tensor([a]), m)
        fm = FairnessMetrics(LengthBins(edges=[0, 10]))
        fm.update_clip(res, None, m, torch.tensor([a]))
        out = fm.compute()
        assert out["clip/seq_frac"] == pytest.approx(binding) and out["clip/tok_frac"] == pytest.approx(binding)
        assert out["fairness/binding_q_bar"] == pytest.approx(1 - binding)
        assert out["band/out_frac"] == pytest.approx(0.5) and out["band/tok_out_frac"] == pytest.approx(0.5)
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
    fm.update_clip(_res(s, up, lo, du), torch.tensor(LENS), m, ADV)
    fm.update_rollout(torch.tensor(LENS), torch.tensor([0, 0, 0, 0, 0, 1]).bool())
    out = fm.compute()
    for k, v in {**_expected_all(), **_expected_band()}.items():
        assert out[k] == pytest.approx(v, abs=1e-12), k
    assert out["rollout/overlong_rate"] == pytest.approx(1 / 6)
    assert "logratio/sigma_hat" in out and "logratio/mean/len_00004_00008" in out
    assert all(METRIC_NAME_RE.match(k) for k in out)
    assert all(isinstance(v, float) and math.isfinite(v) for v in out.values())
    fm.reset()
    assert fm.compute() == {}
    fm.update_clip(_res(s, up, lo, du), None, m, ADV)  # lengths derived
    assert fm.compute()["clip/seq_frac"] == pytest.approx(0.7)
    fm.update_clip(_res(s, up, lo, du), None, m, ADV, log_ratio=False)  # on-policy: S and acceptance once
    out = fm.compute()
    assert out["clip/seq_frac"] == pytest.approx(0.7) and out["logratio/n"] == 5.0 and out["band/n_seq"] == 5.0
    assert int(fm.clip.n_seq.sum()) == 10


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
    fm.update_clip(_res(torch.zeros(6), up, lo, du), None, m, ADV.bfloat16())
    fm.reset()  # defaults kept their dtype too
    fm.update_clip(_res(torch.zeros(6), up, lo, du), None, m, ADV)
    out = fm.compute()
    assert out["fairness/lre_w"] == pytest.approx(3.125 / 8.5, abs=1e-12)
    assert out["fairness/binding_lre_w"] == pytest.approx(3.125 / 8.5, abs=1e-12)


# Acceptance (the paper's event, ClipResult.in_band) vs binding clips, sequence-level rule style,
# T = 10, BINS [0,4) [4,8) [8,inf). (name, L, A, S, binding kind, in band); S is what makes the
# FSPO rule (c = 0.03, c_dual = 0.1; row g: c_dual = null) decide so (test_story_matches_fspo_rule).
STORY = [
    ("a", 2, 1.0, 0.1, "upper", False),    # above the band, A > 0: upper binds
    ("b", 3, -1.0, 0.1, None, False),      # above the band, below the dual bound, A < 0: out of band, no clip binds
    ("c", 3, 1.0, 0.0, None, True),
    ("d", 5, -1.0, 0.5, "dual", False),    # above the dual bound, A < 0: dual clip
    ("e", 6, 1.0, -0.2, None, False),      # below the band, A > 0: out of band, no clip binds
    ("f", 5, 1.0, 0.01, None, True),
    ("g", 8, -1.0, 25.0, "cap", False),    # c_dual null, S > 20, A < 0: only the float-safety cap
    ("h", 9, 1.0, -0.05, None, True),
    ("j", 10, -1.0, 0.2, None, False),
]
ON_POLICY = [(2, 5.0), (2, -5.0), (6, 5.0)]  # (L, A): S = 0, in band, nothing binds


def _story(rows=STORY):
    T = 10
    m = torch.tensor([[1] * r[1] + [0] * (T - r[1]) for r in rows])
    kinds = {k: torch.tensor([r[4] == k for r in rows])[:, None] & m.bool() for k in ("upper", "lower", "dual", "cap")}
    ib = torch.tensor([r[5] for r in rows])[:, None] & m.bool()
    res = ClipResult(torch.zeros(len(rows), T), torch.tensor([r[3] for r in rows]), kinds["upper"], kinds["lower"],
                     kinds["dual"], ib, kinds["cap"])
    return res, m, torch.tensor([r[2] for r in rows])


def _on_policy():
    T = 10
    m = torch.tensor([[1] * L + [0] * (T - L) for L, _ in ON_POLICY])
    no = torch.zeros(len(ON_POLICY), T, dtype=torch.bool)
    return ClipResult(torch.zeros(len(ON_POLICY), T), torch.zeros(len(ON_POLICY)), no, no, no, m.bool()), m, \
        torch.tensor([a for _, a in ON_POLICY])


# binding clips count the on-policy rows either way: n = (5, 4, 3), binding (1, 1, 0), cap (0, 0, 1),
# tokens 51 + 10 = 61, binding 2 + 5, cap 8;
# q = (4/5, 3/4, 1), q_bar = 5/6, LRE = 0.5 (5/25 + 4/10 + 3/5) / 12 = 0.05; sum|A| = (13, 8, 3):
# LRE_w = 0.5 (13/25 + 8/10 + 3/5) / 24 = 0.04
BINDING = {
    "clip/seq_frac/len_00000_00004": 1 / 5, "clip/seq_frac/len_00004_00008": 1 / 4, "clip/seq_frac/len_00008_inf": 0.0,
    "clip/seq_frac_upper/len_00000_00004": 1 / 5, "clip/seq_frac_dual/len_00004_00008": 1 / 4,
    "clip/seq_frac_cap/len_00008_inf": 1 / 3, "clip/seq_frac_cap/len_00000_00004": 0.0,
    "clip/seq_frac": 2 / 12, "clip/seq_frac_upper": 1 / 12, "clip/seq_frac_lower": 0.0, "clip/seq_frac_dual": 1 / 12,
    "clip/seq_frac_cap": 1 / 12, "clip/tok_frac": 7 / 61, "clip/tok_frac_cap": 8 / 61,
    "fairness/binding_lre": 0.05, "fairness/binding_lre_w": 0.04, "fairness/binding_q_bar": 5 / 6,
    "fairness/binding_n_bins": 3.0,
}
# acceptance without the on-policy rows (default): q = (1/3, 1/3, 1/3): perfectly fair, LRE = 0
EXCLUDED = {
    "band/out_frac/len_00000_00004": 2 / 3, "band/out_frac/len_00004_00008": 2 / 3,
    "band/out_frac/len_00008_inf": 2 / 3,
    "band/n_seq/len_00000_00004": 3.0, "band/n_seq/len_00004_00008": 3.0, "band/n_seq/len_00008_inf": 3.0,
    "band/out_frac": 2 / 3, "band/tok_out_frac": 34 / 51, "band/n_seq": 9.0,
    "fairness/lre": 0.0, "fairness/lre_w": 0.0, "fairness/q_bar": 1 / 3, "fairness/n_bins": 3.0,
}
# with them: q = (3/5, 1/2, 1/3), n = (5, 4, 3), q_bar = 1/2, LRE = 0.5 (5/5 + 0 + 3/3) / 12 = 1/12;
# sum|A| = (13, 8, 3): LRE_w = 0.5 (13/5 + 3/3) / 24 = 0.075
INCLUDED = {
    "band/out_frac/len_00000_00004": 2 / 5, "band/out_frac/len_00004_00008": 1 / 2,
    "band/out_frac/len_00008_inf": 2 / 3,
    "band/n_seq/len_00000_00004": 5.0, "band/n_seq/len_00004_00008": 4.0, "band/n_seq/len_00008_inf": 3.0,
    "band/out_frac": 1 / 2, "band/tok_out_frac": 34 / 61, "band/n_seq": 12.0,
    "fairness/lre": 1 / 12, "fairness/lre_w": 0.075, "fairness/q_bar": 1 / 2, "fairness/n_bins": 3.0,
}


def _feed_story(fm, order=("story", "on_policy")):
    for name in order:
        res, m, adv = _story() if name == "story" else _on_policy()
        fm.update_clip(res, None, m, adv, log_ratio=name == "story")  # the training step's call


@pytest.mark.parametrize("include, want", [(False, EXCLUDED), (True, INCLUDED)])
def test_acceptance_vs_binding_by_hand(include, want):
    fm = FairnessMetrics(BINS, reservoir_size=16, acceptance_on_policy=include)
    _feed_story(fm)
    out = fm.compute()
    for k, v in {**BINDING, **want}.items():
        assert out[k] == pytest.approx(v, abs=1e-12), k
    assert out["logratio/n"] == 9.0  # on-policy rows never enter the log-ratio statistics
    assert all(METRIC_NAME_RE.match(k) for k in out)
    # the explicit flag overrides the log_ratio convention
    fm2 = FairnessMetrics(BINS, reservoir_size=16, acceptance_on_policy=include)
    res, m, adv = _on_policy()
    fm2.update_clip(res, None, m, adv, log_ratio=True, on_policy=True)
    assert ("band/n_seq" in fm2.compute()) == include


@pytest.mark.filterwarnings("ignore:.*was called before the ``update`` method")
def test_acceptance_states_sum_exactly_over_a_two_way_split():
    """Sum-reduced states: two halves (each with part of the story and of the on-policy rows), their
    states added (what the ``sum`` reduction does across ranks), equal the whole."""
    whole = FairnessMetrics(BINS, reservoir_size=16)
    _feed_story(whole, order=("on_policy", "story"))
    halves = [FairnessMetrics(BINS, reservoir_size=16) for _ in range(2)]
    for part, fm in zip((slice(0, 4), slice(4, None)), halves):
        res, m, adv = _story(STORY[part])
        fm.update_clip(res, None, m, adv)
        res, m, adv = _on_policy()
        rows = [0] if part.start == 0 else [1, 2]
        sub = ClipResult(res.token_loss[rows], res.seq_log_ratio[rows], res.clip_upper[rows], res.clip_lower[rows],
                         res.clip_dual[rows], res.in_band[rows])
        fm.update_clip(sub, None, m[rows], adv[rows], log_ratio=False)
    merged = ClipFractionByLength(BINS)
    for name in merged._defaults:
        setattr(merged, name, getattr(halves[0].clip, name) + getattr(halves[1].clip, name))
        assert torch.equal(getattr(merged, name), getattr(whole.clip, name)), name
    assert merged.compute() == whole.clip.compute()
    got = merged.compute()
    for k, v in {**BINDING, **EXCLUDED}.items():
        assert got[k] == pytest.approx(v, abs=1e-12), k


def test_story_matches_fspo_rule():
    """The hand-made STORY masks are what FSPOClip returns for its S (c = 0.03, c_dual = 0.1; g: c_dual = null)."""
    from fspo.clipping.fspo import FSPOClip

    T = 10
    L = torch.tensor([r[1] for r in STORY])
    m = (torch.arange(T)[None] < L[:, None]).long()
    lp = (torch.tensor([r[3] for r in STORY]) / L)[:, None] * m
    adv = torch.tensor([r[2] for r in STORY])
    dual = FSPOClip(c_upper=0.03, c_lower=0.03, c_dual=0.1)(lp, torch.zeros_like(lp), adv, m)
    cap = FSPOClip(c_upper=0.03, c_lower=0.03, c_dual=None)(lp, torch.zeros_like(lp), adv, m)
    want, _, _ = _story()
    for i, r in enumerate(STORY):
        res = cap if r[0] == "g" else dual
        for k in ("clip_upper", "clip_lower", "clip_dual", "clip_cap", "in_band"):
            assert torch.equal(getattr(res, k)[i], getattr(want, k)[i]), (r[0], k)
