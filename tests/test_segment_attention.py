"""Segment attention (fspo/models/segment_attention.py) and the one-row packing it reads
(fspo/update/packing.py `pack_segments`, `segment_micro_batches`).

Checked: runs and the one-row layout by hand; packed log-probs, entropies and gradients equal the
padded pass (itself pinned to a float64 manual computation in tests/test_logprobs.py) with a mix
of equal and distinct lengths and an empty response; generation and the padded pass of a model
switched to segment attention are those of sdpa (same tokens, same numbers); micro-batches
cover every sequence within the token budget; only sdpa models are switched; and an RL update
with packing on uses it, with zero padding waste.
"""
from __future__ import annotations

import copy

import pytest
import torch
from test_packing import batch_of, random_batch

from fspo.models.segment_attention import (
    SEGMENT_ATTENTION,
    enable_segment_attention,
    segment_runs,
    uses_segment_attention,
)
from fspo.models.tiny import build_tiny_model
from fspo.update.logprobs import response_log_probs
from fspo.update.packing import TokenUsage, pack_segments, segment_micro_batches


def test_segment_runs_by_hand():
    assert segment_runs([5, 5, 3, 3, 3, 2]) == [(0, 2, 5), (10, 3, 3), (19, 1, 2)]
    assert segment_runs([4, 0, 4]) == [(0, 2, 4)]  # an empty sequence takes no room and breaks nothing
    assert segment_runs([]) == []


def test_pack_segments_layout_by_hand():
    b = batch_of([([5, 6], [7, 8, 9]), ([11], [12]), ([21, 22, 23], [24, 25])])  # totals 5, 2, 5
    lay = pack_segments(b)
    # longest first, ties in batch order: rows 0, 2, 1
    assert lay.input_ids.tolist() == [[5, 6, 7, 8, 9, 21, 22, 23, 24, 25, 11, 12]]
    assert lay.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1]]
    assert lay.segments == [(0, 2, 5), (10, 1, 2)]
    # response token t of sequence i is predicted by the logit just before it
    assert lay.logit_index.tolist() == [[1, 2, 3], [10, 0, 0], [7, 8, 0]]
    assert lay.real_tokens == lay.slots == 12


def _pair(seed=0):
    ref = build_tiny_model(seed=seed)
    seg = copy.deepcopy(ref)
    assert enable_segment_attention(seg) and uses_segment_attention(seg)
    return ref, seg


def test_packed_segments_equal_the_padded_pass_with_gradients():
    ref, seg = _pair()
    batch = random_batch(n=10, seed=3)
    same = batch_of([([4, 5, 6], [7] * 9)] * 3 + [([8, 9], [])])  # equal lengths (one run) + an empty response
    for b in (batch, same):
        used = TokenUsage()
        lp_pad, ent_pad = response_log_probs(ref, b, with_entropy=True)
        lp_seg, ent_seg = response_log_probs(seg, b, with_entropy=True, pack_width=0, usage=used)
        torch.testing.assert_close(lp_seg, lp_pad, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ent_seg, ent_pad, atol=1e-5, rtol=1e-5)
        assert used.waste == 0.0 and used.tokens == int(b.prompt_mask.sum() + b.response_mask.sum())
        ref.zero_grad()
        seg.zero_grad()
        (lp_pad.sum() / b.response_mask.sum()).backward()
        (lp_seg.sum() / b.response_mask.sum()).backward()
        for (name, p), q in zip(ref.named_parameters(), seg.parameters()):
            torch.testing.assert_close(q.grad, p.grad, atol=1e-6, rtol=1e-4, msg=name)


def test_generation_and_padded_pass_are_sdpa_unchanged():
    from fspo.rollout.base import SamplingConfig
    from fspo.rollout.decode import decode_compact
    from fspo.rollout.hf import left_pad

    ref, seg = _pair(seed=4)
    ids, mask = left_pad([[5, 6, 7], [9], [11, 12, 13, 14, 15]], 0)  # left padding: masks matter
    params = SamplingConfig(n=1, temperature=0.0, max_new_tokens=12)
    a, b = decode_compact(ref.eval(), ids, mask, params, 2, 0), decode_compact(seg.eval(), ids, mask, params, 2, 0)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.log_probs, b.log_probs)
    batch = random_batch(n=6, seed=5)
    with torch.no_grad():
        assert torch.equal(response_log_probs(ref, batch)[0], response_log_probs(seg, batch)[0])


def test_segment_micro_batches_cover_every_sequence_within_the_budget():
    totals = torch.tensor([10, 3, 7, 4, 6, 2, 1, 9, 5, 5, 30])
    groups = segment_micro_batches(totals, 20)
    assert sorted(i for g in groups for i in g.tolist()) == list(range(11))
    assert all(int(totals[g].sum()) <= 20 or len(g) == 1 for g in groups)
    assert [g.tolist() for g in groups if int(totals[g].sum()) > 20] == [[10]]  # 30 tokens go alone
    assert len(groups) == 1 + 3  # 52 tokens in bins of 20: first-fit decreasing needs 3
    assert segment_micro_batches(torch.tensor([], dtype=torch.long), 8) == []
    with pytest.raises(ValueError, match="micro_batch_max_tokens"):
        segment_micro_batches(totals, 0)


def test_only_sdpa_models_are_switched():
    eager = build_tiny_model(seed=0)
    eager.set_attn_implementation("eager")
    assert not enable_segment_attention(eager) and eager.config._attn_implementation == "eager"
    sdpa = build_tiny_model(seed=0)
    assert enable_segment_attention(sdpa) and sdpa.config._attn_implementation == SEGMENT_ATTENTION
    # a sliding-window layer would need the window inside each sequence: left on sdpa and its masks
    window = build_tiny_model(seed=0, use_sliding_window=True, sliding_window=8, max_window_layers=2)
    assert "sliding_attention" in window.config.layer_types
    assert not enable_segment_attention(window) and window.config._attn_implementation == "sdpa"


def test_rl_update_with_packing_uses_segments_without_waste():
    from test_module_update import make_rollout, run_update

    module, grads, m = run_update(make_rollout(), packing=True)
    assert uses_segment_attention(module.policy)
    assert m["perf/padding_waste"] == 0.0 and len(grads) == 2
    module, _, m = run_update(make_rollout(), packing=False)
    assert not uses_segment_attention(module.policy) and m["perf/padding_waste"] > 0.0


def test_activation_checkpointing_passes_the_segments_through():
    """HF gradient checkpointing recomputes each layer with the same keyword arguments: the segment
    pass gives the same log-probs and gradients with it on."""
    ref, seg = _pair(seed=2)
    seg.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref.train()
    seg.train()
    batch = random_batch(n=8, seed=7)
    lp_ref, _ = response_log_probs(ref, batch)
    lp_seg, _ = response_log_probs(seg, batch, pack_width=0)
    torch.testing.assert_close(lp_seg, lp_ref, atol=1e-5, rtol=1e-5)
    lp_ref.sum().backward()
    lp_seg.sum().backward()
    for (name, p), q in zip(ref.named_parameters(), seg.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-5, rtol=1e-4, msg=name)
