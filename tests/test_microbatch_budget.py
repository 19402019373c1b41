"""Token-budget micro-batching (``ppo.micro_batch_max_tokens``, verl's use_dynamic_bsz with
ppo_max_token_len_per_gpu) leaves the loss and the gradient of every optimizer step unchanged.

Each mini-batch is split into micro-batches by a token budget; each micro-batch's
loss is aggregated with the MINI-BATCH's denominators (its total response tokens for token-mean, its
sequence count for the seq-mean modes, its response width for seq-mean-token-sum-norm), so the
micro-batch losses and gradients sum to the unsplit mini-batch's. Checked here through the real
Lightning step (tests/test_module_update.py's `run_update`: plain SGD, every gradient recorded) for
every aggregation mode x FSPO, GRPO, RLOO and GSPO (and token-mean for the other clip rules), in the
packed one-row layout (the default) and the padded one, with a budget that splits each 4-sequence
mini-batch into many micro-batches and with a budget below EVERY sequence (each sequence then runs
alone: the documented choice, docs/memory.md), against one micro-batch per mini-batch.
With several FSDP ranks every rank runs the largest micro-batch count of any rank (zero-weight
dummy micro-batches): tests/test_fsdp.py and tests/test_fsdp_lm_head.py check on 2 gloo ranks that a
step with uneven counts equals one process. The config check warns when the budget is below the
longest possible sequence (tests below).
"""
from __future__ import annotations

import pytest
import torch
from test_module_update import make_rollout, run_update

from fspo.losses import AGG_MODES
from fspo.update.forward import dummy_micro_batch
from fspo.update.microbatches import token_budget_micro_batches
from fspo.update.packing import segment_micro_batches

GRID = [(clip, mode) for clip in ("fspo", "grpo", "rloo", "gspo") for mode in AGG_MODES]
OTHERS = [(clip, "token-mean") for clip in ("cispo", "gmpo", "luspo", "sapo", "fspo_quantile")]
SPLIT, BELOW_EVERY = 24, 5  # tokens: many micro-batches per mini-batch; below every sequence (min 4 + 1)


def _assert_same_update(one, many):
    (m1, g1, x1), (m2, g2, x2) = one, many
    assert len(g1) == len(g2) == 2  # 8 sequences in mini-batches of 4: two optimizer steps
    for step, (a, b) in enumerate(zip(g1, g2)):
        assert a.keys() == b.keys() and a and sum(float(v.abs().sum()) for v in a.values()) > 0
        for name in a:
            torch.testing.assert_close(b[name], a[name], atol=1e-6, rtol=0, msg=f"update {step}: grad {name}")
    for (name, p1), (_, p2) in zip(m1.policy.named_parameters(), m2.policy.named_parameters()):
        torch.testing.assert_close(p2, p1, atol=1e-6, rtol=0, msg=name)
    assert x1["train/loss"] != 0.0
    for key in ("train/loss", "train/kl", "clip/seq_frac", "clip/tok_frac"):
        assert x2[key] == pytest.approx(x1[key], abs=1e-6, rel=1e-5), key


@pytest.mark.slow
@pytest.mark.parametrize("packing", [True, False])
@pytest.mark.parametrize("clip_name,agg_mode", GRID + OTHERS)
def test_token_budget_split_equals_unsplit(clip_name, agg_mode, packing):
    rollout = make_rollout()
    totals = rollout.prompt_mask.sum(-1) + rollout.lengths
    split = (segment_micro_batches if packing else token_budget_micro_batches)(totals, SPLIT)
    assert len(split) >= 5  # the budget really splits the two 4-sequence mini-batches
    one = run_update(rollout, clip_name, agg_mode, sgd=True, micro_batch_max_tokens=100_000, packing=packing)
    many = run_update(rollout, clip_name, agg_mode, sgd=True, micro_batch_max_tokens=SPLIT, packing=packing)
    _assert_same_update(one, many)


@pytest.mark.parametrize("packing", [True, False])
@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-mean"])
def test_budget_below_every_sequence_runs_each_alone_and_equals_unsplit(agg_mode, packing):
    rollout = make_rollout()
    totals = rollout.prompt_mask.sum(-1) + rollout.lengths
    assert int(totals.min()) > BELOW_EVERY
    for fn in (segment_micro_batches, token_budget_micro_batches):
        assert sorted(len(g) for g in fn(totals, BELOW_EVERY)) == [1] * len(totals)  # one sequence each
    one = run_update(rollout, "fspo", agg_mode, sgd=True, micro_batch_max_tokens=100_000, packing=packing)
    alone = run_update(rollout, "fspo", agg_mode, sgd=True, micro_batch_max_tokens=BELOW_EVERY, packing=packing)
    _assert_same_update(one, alone)


def test_dummy_micro_batch_is_the_shortest_sequence():
    rollout = make_rollout()
    totals = rollout.prompt_mask.sum(-1) + rollout.lengths
    d = dummy_micro_batch(rollout)
    assert d.batch_size == 1 and int(d.prompt_mask.sum() + d.lengths.sum()) == int(totals.min())
    assert d.response_ids.shape[1] == int(d.lengths[0])  # trimmed to its own length


def test_config_warns_when_the_budget_is_below_the_longest_sequence():
    from conftest import compose_config
    from fspo.runtime.checks.config_check import check_config

    assert check_config(compose_config([])) == []
    cfg = compose_config(["ppo.micro_batch_max_tokens=50", "data.max_prompt_len=64",
                          "rollout.sampling.max_new_tokens=128"])
    (warning,) = check_config(cfg)
    assert warning.startswith("ppo.micro_batch_max_tokens=50 is below the longest possible sequence") and \
        "set it >= 192" in warning
