"""fspo/rollout/decode.py: the compact decoder samples what ``model.generate`` samples, and its
decode work is the sum of the real lengths, not rows x the longest.

- greedy: token for token equal to ``model.generate`` on the committed warm-start model, whose
  arithmetic answers end at EOS after different numbers of tokens (rows leave the batch early);
- sampling: the empirical distribution of the first token over 4000 rows matches the processed
  distribution computed here by hand from the model's logits (temperature, then top-k, then
  top-p renormalisation): within 4 binomial standard deviations for every token of probability
  >= 0.005, total variation < 0.03, and never a token outside the top-k / nucleus;
- prefill: once per distinct prompt (the n samples of a prompt share its KV cache);
- work: a forward hook counts the rows of every one-token decode forward; on the chain model of
  tests/test_hf_engine.py (lengths 3, 1, 5) that is sum(len - 1) = 6, where ``generate`` runs
  all 3 rows for 4 steps (12).
"""
from __future__ import annotations

import pytest
import torch
from test_hf_engine import EOS, PAD, chain_model, ids

from fspo.models.loading import load_policy
from fspo.models.tiny import build_tiny_model
from fspo.rollout.base import SamplingConfig
from fspo.rollout.decode import decode_compact
from fspo.rollout.hf import left_pad


def test_greedy_equals_generate_with_rows_finishing_early():
    model, tok = load_policy(source="warmstart")
    model.eval()
    prompts = [tok.encode(p) for p in ["Q:2+7+4-5\nA:", "Q:1+1\nA:", "Q:9-3+8-1+6\nA:", "Q:5+5\nA:"]]
    input_ids, mask = left_pad(prompts, tok.pad_token_id)
    params = SamplingConfig(n=1, temperature=0.0, max_new_tokens=60)
    ours = decode_compact(model, input_ids, mask, params, tok.eos_token_id, tok.pad_token_id).tokens
    with torch.no_grad():
        ref = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=60, do_sample=False,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)[:, input_ids.shape[1]:]
    lengths = [(r == tok.eos_token_id).nonzero()[0, 0].item() + 1 for r in ours]
    assert len(set(lengths)) > 1 and max(lengths) < 60  # rows really finish at different steps
    ref = torch.nn.functional.pad(ref, (0, 60 - ref.shape[1]), value=tok.pad_token_id)
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.6)])
def test_first_token_distribution_matches_the_processed_softmax(temperature, top_k, top_p):
    model = build_tiny_model(seed=4, initializer_range=0.3).eval()
    prompt = ids("Q:3+4\nA:")
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[0, -1].double()
    # by hand: temperature, keep the top-k, keep the smallest top set with mass >= top_p, renormalise
    p = torch.softmax(logits / temperature, -1)
    order = p.argsort(descending=True)
    keep = torch.zeros_like(p, dtype=torch.bool)
    mass = 0.0
    for rank, i in enumerate(order.tolist()):
        if (top_k and rank >= top_k) or mass >= top_p:
            break
        keep[i] = True
        mass += float(p[i])
    expected = torch.where(keep, p, torch.zeros_like(p))
    expected /= expected.sum()

    n = 4000
    input_ids = torch.tensor([prompt] * n)
    params = SamplingConfig(n=1, temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=1)
    torch.manual_seed(0)
    first = decode_compact(model, input_ids, torch.ones_like(input_ids), params, EOS, PAD).tokens[:, 0]
    freq = torch.bincount(first, minlength=p.numel()).double() / n
    assert (freq[~keep] == 0).all()  # nothing outside the top-k / nucleus is ever sampled
    common = expected >= 0.005  # enough expected counts (>= 20) for the normal approximation
    sd = (expected * (1 - expected) / n).sqrt()
    assert ((freq - expected).abs() <= 4 * sd)[common].all()
    assert 0.5 * float((freq - expected).abs().sum()) < 0.03  # total variation over all tokens
    assert int(keep.sum()) > 1  # the test has power: more than one token is possible


def test_decode_work_is_the_sum_of_real_lengths():
    model = chain_model()
    rows = []
    hook = model.model.register_forward_hook(
        lambda mod, args, kwargs, out: rows.append(kwargs["input_ids"].shape[0])
        if kwargs["input_ids"].shape[1] == 1 else None, with_kwargs=True)
    prompts = [ids("Q:a"), ids("c"), ids("x")]  # completions: "bc</s>" (3), "</s>" (1), "xxxxx" (5, no EOS)
    input_ids, mask = left_pad(prompts, PAD)
    out = decode_compact(model, input_ids, mask, SamplingConfig(n=1, temperature=1.0, max_new_tokens=5, seed=0),
                         EOS, PAD).tokens
    hook.remove()
    b, c, x = (ids(ch)[0] for ch in "bcx")
    assert out.tolist() == [[b, c, EOS, PAD, PAD], [EOS, PAD, PAD, PAD, PAD], [x] * 5]
    assert sum(rows) == (3 - 1) + (1 - 1) + (5 - 1) == 6  # generate: 3 rows x 4 decode steps = 12
    assert rows == [2, 2, 1, 1]


def test_prefill_runs_once_per_distinct_prompt():
    """The n samples of a prompt share one prefill (its KV cache is copied row by row): with 2
    distinct prompts x 3 copies the prefill forward sees 2 rows, and greedy decoding still equals
    ``model.generate`` on all 6 rows."""
    model, tok = load_policy(source="warmstart")
    model.eval()
    prompts = [tok.encode(p) for p in ["Q:2+7+4-5\nA:", "Q:1+1\nA:"] for _ in range(3)]
    input_ids, mask = left_pad(prompts, tok.pad_token_id)
    prefill = []
    hook = model.model.register_forward_hook(
        lambda mod, args, kwargs, out: prefill.append(kwargs["input_ids"].shape[0])
        if kwargs["input_ids"].shape[1] > 1 else None, with_kwargs=True)
    ours = decode_compact(model, input_ids, mask, SamplingConfig(n=1, temperature=0.0, max_new_tokens=40),
                          tok.eos_token_id, tok.pad_token_id).tokens
    hook.remove()
    assert prefill == [2]
    with torch.no_grad():
        ref = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=40, do_sample=False,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)[:, input_ids.shape[1]:]
    ref = torch.nn.functional.pad(ref, (0, 40 - ref.shape[1]), value=tok.pad_token_id)
    assert torch.equal(ours, ref)
