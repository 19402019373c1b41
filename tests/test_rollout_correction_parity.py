"""Parity of the fixed-cap modes of fspo/rollout/correction.py with the peers' mismatch corrections:
TRL 1.16's ``vllm_importance_sampling_mode`` (its formulas, read from GRPOTrainer._generate_and_score_completions
and re-derived in `trl_weights`; hand-computed cases pin them) and verl 0.9.1's rollout correction (its own
`compute_rollout_correction_weights` and `compute_rollout_rejection_mask`, called here). The mapping is in
docs/rollout_correction_parity.md.
"""
from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Optional

import pytest
import torch

from fspo.rollout.correction import RolloutCorrection

E = math.exp


def rows():
    """S = 0.9, -1.1, 1.5, -0.2 over 2, 1, 2, 1 tokens (d = 0.4 0.5 | -1.1 | 1.0 0.5 | -0.2), then an empty row."""
    d = torch.tensor([[0.4, 0.5], [-1.1, 0.0], [1.0, 0.5], [-0.2, 0.0], [0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 0], [0, 0]])
    engine = torch.tensor([[-1.0, -2.0], [-0.5, -0.7], [-3.0, -0.1], [-0.3, 0.0], [-1.0, -1.0]], dtype=torch.float64)
    return engine + d * mask, engine, mask


def ours(old, engine, mask, mode: str, cap: float, cap_min: Optional[float] = None) -> torch.Tensor:
    c = RolloutCorrection(mode=mode, cap=cap, cap_min=cap_min, bin_width=1, max_len=max(old.shape[1], 2))
    batch = SimpleNamespace(old_log_probs=old, engine_log_probs=engine, response_mask=mask,
                            advantages=torch.ones(old.shape[0]))
    c.fit(batch)
    return c.weights(batch).double()


def trl_weights(old, sampling, mask, mode: str, clip_min: Optional[float], clip_max: Optional[float]) -> torch.Tensor:
    """TRL 1.16 (float32, as its trainer): diff = (old - sampling) * mask, NaN -> 0; sequence modes sum it over
    the response; ratio = exp(diff); *_truncate: clamp(ratio, clip_min, clip_max); *_mask: ratio set to 0 where
    ratio < clip_min or ratio > clip_max (None: no bound). The [B, 1] sequence ratio multiplies every token."""
    diff = torch.nan_to_num((old.float() - sampling.float()) * mask.float(), nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        ratio = torch.clamp(ratio, min=clip_min, max=clip_max)
    else:
        lo = -math.inf if clip_min is None else clip_min
        hi = math.inf if clip_max is None else clip_max
        ratio = ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)
    return ratio.expand(mask.shape).double() * mask


# ---- hand-computed -------------------------------------------------------------------------------------
HAND = [  # (TRL mode, clip_min, clip_max) -> our (mode, cap, cap_min), per-sequence weights of S = 0.9, -1.1, 1.5, -0.2
    (("sequence_truncate", None, 3.0), ("seq_is", 3.0, None), [E(0.9), E(-1.1), 3.0, E(-0.2)]),
    (("sequence_truncate", 0.5, 3.0), ("seq_is", 3.0, 0.5), [E(0.9), 0.5, 3.0, E(-0.2)]),
    (("sequence_mask", None, 3.0), ("seq_masked_is", 3.0, None), [E(0.9), E(-1.1), 0.0, E(-0.2)]),
    (("sequence_mask", 0.5, 3.0), ("seq_masked_is", 3.0, 0.5), [E(0.9), 0.0, 0.0, E(-0.2)]),
]


@pytest.mark.parametrize("trl, fspo, want", HAND, ids=[f"{h[0][0]}-{h[0][1]}" for h in HAND])
def test_trl_sequence_modes_by_hand(trl, fspo, want):
    old, engine, mask = rows()
    w = torch.tensor(want + [0.0], dtype=torch.float64)[:, None] * mask
    torch.testing.assert_close(trl_weights(old, engine, mask, *trl), w, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ours(old, engine, mask, *fspo), w, rtol=1e-6, atol=1e-7)


def test_trl_token_truncate_by_hand():
    old, engine, mask = rows()
    w = torch.tensor([[E(0.4), E(0.5)], [E(-1.1), 0], [E(1.0), E(0.5)], [E(-0.2), 0], [0, 0]], dtype=torch.float64)
    w = w.clamp(max=2.0)  # e^1 = 2.718 -> 2
    torch.testing.assert_close(trl_weights(old, engine, mask, "token_truncate", None, 2.0), w, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ours(old, engine, mask, "token_tis", 2.0), w, rtol=1e-6, atol=1e-7)


def test_verl_modes_by_hand():
    old, engine, mask = rows()
    col = lambda v: torch.tensor(v + [0.0], dtype=torch.float64)[:, None] * mask  # noqa: E731
    # rollout_rs=seq_sum_k1, threshold 2.0 (lower 1/2): keep |S| <= log 2 = 0.693 -> only S = -0.2
    torch.testing.assert_close(ours(old, engine, mask, "seq_mask", 2.0), col([0.0, 0.0, 0.0, 1.0]))
    # threshold "0.5_4" bounds exp(-S) (k1 = -log ratio): keep -log 4 <= S <= log 2 -> S = -1.1 and -0.2
    torch.testing.assert_close(ours(old, engine, mask, "seq_mask", 2.0, 0.25), col([0.0, 1.0, 0.0, 1.0]))
    # rollout_is=sequence, threshold 2.0 (TIS): min(e^S, 2)
    torch.testing.assert_close(ours(old, engine, mask, "seq_is", 2.0), col([2.0, E(-1.1), 2.0, E(-0.2)]), rtol=1e-6,
                               atol=1e-7)
    # rollout_is=sequence, threshold "0.5_3" (IcePop): e^S inside [0.5, 3], else 0
    torch.testing.assert_close(ours(old, engine, mask, "seq_masked_is", 3.0, 0.5), col([E(0.9), 0.0, 0.0, E(-0.2)]),
                               rtol=1e-6, atol=1e-7)


# ---- random batches: TRL's formulas and verl's own functions -------------------------------------------
def random_batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    B, T = 64, 48
    engine = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    d = torch.randn(B, T, generator=g, dtype=torch.float64) * 0.2
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    mask[5] = 0
    mask[7], mask[8] = 0, 0
    d[7, :2], mask[7, :2] = torch.tensor([25.0, -22.0], dtype=torch.float64), 1  # the per-token clamp matters
    d[8, 0], mask[8, 0] = -30.0, 1  # S < -20 (L = 1)
    return engine + d * mask, engine, mask


def near_boundary(s: torch.Tensor, bounds) -> torch.Tensor:
    """Rows whose S is within 1e-4 of a bound (float32 vs float64 may decide them differently)."""
    out = torch.zeros_like(s, dtype=torch.bool)
    for b in bounds:
        if b is not None and b > 0:
            out |= (s - math.log(b)).abs() < 1e-4
    return out


TRL_MAP = [("sequence_truncate", None, 3.0, "seq_is"), ("sequence_truncate", 0.2, 3.0, "seq_is"),
           ("sequence_mask", None, 3.0, "seq_masked_is"), ("sequence_mask", 0.5, 2.0, "seq_masked_is"),
           ("token_truncate", None, 2.0, "token_tis")]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("trl_mode, lo, hi, mode", TRL_MAP)
def test_trl_parity_on_random_batches(seed, trl_mode, lo, hi, mode):
    old, engine, mask = random_batch(seed)
    ref = trl_weights(old, engine, mask, trl_mode, lo, hi)
    w = ours(old, engine, mask, mode, hi, lo)
    s = ((old - engine) * mask).sum(-1)
    keep = ~near_boundary(s, (lo, hi))
    assert keep.sum() > 50
    # atol e^-20: where TRL's exp() of a log-ratio below -20 (rows 7 and 8) is smaller, ours is e^-20 (verl's clamp)
    torch.testing.assert_close(w[keep], ref[keep], rtol=2e-6, atol=E(-20.0))
    assert ((w > 0) == (ref > 0))[keep].all()


verl_rc = pytest.importorskip("verl.trainer.ppo.rollout_corr_helper", reason="verl 0.9.1 as .ci/run installs it")


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("threshold, mode, cap, cap_min", [
    (2.0, "seq_is", 2.0, None), (5.0, "seq_is", 5.0, None),     # TIS
    ("0.5_3.0", "seq_masked_is", 3.0, 0.5)])                    # IcePop
def test_verl_rollout_is_sequence(seed, threshold, mode, cap, cap_min):
    old, engine, mask = random_batch(seed)
    ref, _ = verl_rc.compute_rollout_correction_weights(old - engine, mask.double(), rollout_is="sequence",
                                                        rollout_is_threshold=threshold)
    w = ours(old, engine, mask, mode, cap, cap_min)
    keep = ~near_boundary(((old - engine) * mask).sum(-1), (cap, cap_min))
    torch.testing.assert_close(w[keep], ref[keep], rtol=2e-6, atol=1e-9)


@pytest.mark.parametrize("seed", [0, 1])
def test_verl_rollout_is_token(seed):
    old, engine, mask = random_batch(seed)
    ref, _ = verl_rc.compute_rollout_correction_weights(old - engine, mask.double(), rollout_is="token",
                                                        rollout_is_threshold=2.0)
    torch.testing.assert_close(ours(old, engine, mask, "token_tis", 2.0), ref, rtol=2e-6, atol=1e-9)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("threshold, cap, cap_min", [(2.0, 2.0, None), (3.0, 3.0, None), ("0.5_4.0", 2.0, 0.25)])
def test_verl_rejection_seq_sum_k1(seed, threshold, cap, cap_min):
    old, engine, mask = random_batch(seed)
    kept, _ = verl_rc.compute_rollout_rejection_mask(old - engine, mask.double(), rollout_rs="seq_sum_k1",
                                                     rollout_rs_threshold=threshold)
    w = ours(old, engine, mask, "seq_mask", cap, cap_min)
    s = ((old - engine).clamp(-20, 20) * mask).sum(-1)
    keep = ~near_boundary(s, (cap, 1 / cap if cap_min is None else cap_min))
    # verl drops a rejected sequence's tokens from the response mask; we weight them 0 and keep them in the
    # aggregation's denominators (as TRL does): the same tokens are rejected
    assert torch.equal(w[keep], kept[keep].double())
    assert w[7].sum() == 2 and kept[7].sum() == 2  # row 7: d = 25, -22 is S' = 20 - 20 = 0 after the per-token clamp


def test_cap_min_is_checked():
    with pytest.raises(ValueError, match="cap_min"):
        RolloutCorrection(mode="seq_is", cap=2.0, cap_min=1.5)
