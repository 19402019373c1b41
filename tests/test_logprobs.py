"""`response_log_probs` against a manual float64 log_softmax/gather, alone vs inside a padded batch.

The random tiny model uses ``initializer_range=0.1`` so that its outputs depend on context (at
the default 0.02 the logits are nearly context-free, so a padding bug could hide below the
tolerance); `test_attending_to_padding_would_be_caught` shows the batch test has that power.
Note that Qwen3's rotary embeddings are relative: shifting every position of a row by its pad
count changes nothing, so with this architecture it is the attention mask, not the position ids,
that the left-padding check exercises.
"""
from __future__ import annotations

import pytest
import torch

from fspo.models.tiny import build_tiny_model
from fspo.types import RolloutBatch
from fspo.update.logprobs import response_log_probs

PAD = 0
SHORT_PROMPT, SHORT_RESP = [20, 31, 42, 53], [60, 61, 2]          # P=4, L=3
LONG_PROMPT, LONG_RESP = [21, 22, 23, 24, 25, 26, 27], [70, 71, 72, 73, 74]  # P=7, L=5


@pytest.fixture(scope="module")
def model():
    return build_tiny_model(seed=0, initializer_range=0.1).eval()


def batch_of(rows):
    """RolloutBatch from (prompt, response) lists: prompts left-padded, responses right-padded."""
    p = max(len(a) for a, _ in rows)
    t = max(len(b) for _, b in rows)
    pi = torch.tensor([[PAD] * (p - len(a)) + a for a, _ in rows])
    pm = torch.tensor([[0] * (p - len(a)) + [1] * len(a) for a, _ in rows])
    ri = torch.tensor([b + [PAD] * (t - len(b)) for _, b in rows])
    rm = torch.tensor([[1] * len(b) + [0] * (t - len(b)) for _, b in rows])
    return RolloutBatch(prompt_ids=pi, prompt_mask=pm, response_ids=ri, response_mask=rm).validate()


def manual(model, prompt, resp, temperature=1.0):
    """(logp [L], entropy [L]) in float64 from one unpadded forward pass."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + resp])).logits[0].double()
    z = logits[len(prompt) - 1:len(prompt) - 1 + len(resp)] / temperature
    logp_all = torch.log_softmax(z, dim=-1)
    logp = logp_all[torch.arange(len(resp)), torch.tensor(resp)]
    ent = -(logp_all.exp() * logp_all).sum(-1)
    return logp, ent


def test_alone_equals_manual(model):
    lp, ent = response_log_probs(model, batch_of([(SHORT_PROMPT, SHORT_RESP)]), with_entropy=True)
    ref_lp, ref_ent = manual(model, SHORT_PROMPT, SHORT_RESP)
    assert lp.dtype == torch.float32 and lp.shape == (1, 3)
    torch.testing.assert_close(lp[0].double(), ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent[0].double(), ref_ent, atol=1e-5, rtol=0)


def test_left_padded_batch_equals_alone(model):
    both = batch_of([(SHORT_PROMPT, SHORT_RESP), (LONG_PROMPT, LONG_RESP)])  # short row: 3 pads left, 2 right
    lp, ent = response_log_probs(model, both, with_entropy=True)
    alone, _ = response_log_probs(model, batch_of([(SHORT_PROMPT, SHORT_RESP)]))
    torch.testing.assert_close(lp[0, :3], alone[0], atol=1e-5, rtol=0)
    for i, (p, r) in enumerate([(SHORT_PROMPT, SHORT_RESP), (LONG_PROMPT, LONG_RESP)]):
        ref_lp, ref_ent = manual(model, p, r)
        torch.testing.assert_close(lp[i, :len(r)].double(), ref_lp, atol=1e-5, rtol=0)
        torch.testing.assert_close(ent[i, :len(r)].double(), ref_ent, atol=1e-5, rtol=0)
    # padding positions are exactly 0
    assert lp[0, 3:].tolist() == [0.0, 0.0] and ent[0, 3:].tolist() == [0.0, 0.0]


def test_attending_to_padding_would_be_caught(model):
    """Without the attention mask the left-padded row's log-probs move by far more than the
    tolerance: the batch-vs-alone equality above is a real check."""
    both = batch_of([(SHORT_PROMPT, SHORT_RESP), (LONG_PROMPT, LONG_RESP)])
    with torch.no_grad():
        logits = model(input_ids=both.input_ids()).logits[0].double()
    p = both.prompt_ids.shape[1]
    wrong = torch.log_softmax(logits[p - 1:p + 2], -1)[torch.arange(3), torch.tensor(SHORT_RESP)]
    ref_lp, _ = manual(model, SHORT_PROMPT, SHORT_RESP)
    assert (wrong - ref_lp).abs().max() > 0.1


@pytest.mark.parametrize("temperature", [0.5, 1.7])
def test_temperature_divides_logits(model, temperature):
    both = batch_of([(SHORT_PROMPT, SHORT_RESP), (LONG_PROMPT, LONG_RESP)])
    lp, ent = response_log_probs(model, both, temperature=temperature, with_entropy=True)
    plain, _ = response_log_probs(model, both, temperature=1.0)
    for i, (p, r) in enumerate([(SHORT_PROMPT, SHORT_RESP), (LONG_PROMPT, LONG_RESP)]):
        ref_lp, ref_ent = manual(model, p, r, temperature)
        torch.testing.assert_close(lp[i, :len(r)].double(), ref_lp, atol=1e-5, rtol=0)
        torch.testing.assert_close(ent[i, :len(r)].double(), ref_ent, atol=1e-5, rtol=0)
    assert (lp - plain).abs().max() > 1e-3  # the temperature was applied


def test_gradient_flows_through_logp_not_entropy(model):
    lp, ent = response_log_probs(model, batch_of([(LONG_PROMPT, LONG_RESP)]), with_entropy=True)
    assert lp.requires_grad and not ent.requires_grad
    lp.sum().backward()
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() > 0
    model.zero_grad(set_to_none=True)


def test_entropy_of_uniform_logits_is_log_vocab():
    """Hand-computed case: a model whose logits are all equal has entropy log V and logp -log V."""
    m = build_tiny_model(seed=0).eval()
    with torch.no_grad():
        m.lm_head.weight.zero_()  # tied: zero logits everywhere
    lp, ent = response_log_probs(m, batch_of([(SHORT_PROMPT, SHORT_RESP)]), temperature=0.7, with_entropy=True)
    v = m.config.vocab_size
    torch.testing.assert_close(lp, torch.full((1, 3), -torch.log(torch.tensor(float(v)))), atol=1e-6, rtol=0)
    torch.testing.assert_close(ent, torch.full((1, 3), torch.log(torch.tensor(float(v)))), atol=1e-6, rtol=0)


# ------------------------------------------------------------------ chunked LM head (ppo.lm_head_chunk_rows)
@pytest.mark.parametrize("pack_width", [None, 0, 16])
@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_chunked_head_equals_dense_values_entropy_and_gradients(pack_width, chunk):
    """``head_chunk_rows`` > 0 runs the model's body, then the LM head in chunks
    (fspo/update/lm_head.py); log-probs, entropies and every parameter's gradient equal the dense
    path's, in the padded (None), one-row segment (0 on an sdpa model with segment attention) and
    packed-rows (16, no segment attention) layouts."""
    from fspo.models.segment_attention import enable_segment_attention

    rows = [(SHORT_PROMPT, SHORT_RESP), (LONG_PROMPT, LONG_RESP)]
    results = []
    for head_chunk in (0, chunk):
        m = build_tiny_model(seed=0, initializer_range=0.1).train()
        if pack_width == 0:
            enable_segment_attention(m)
        lp, ent = response_log_probs(m, batch_of(rows), temperature=0.7, with_entropy=True,
                                     pack_width=pack_width, head_chunk_rows=head_chunk)
        (lp * torch.tensor([[1.0], [0.5]])).sum().backward()
        results.append((lp.detach(), ent, {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}))
    (lp0, ent0, g0), (lp1, ent1, g1) = results
    torch.testing.assert_close(lp1, lp0, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent1, ent0, atol=1e-5, rtol=0)
    assert g1.keys() == g0.keys() and any("lm_head" in n or "embed_tokens" in n for n in g0)  # the head's weight
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], atol=1e-5, rtol=1e-4, msg=n)
    ref_lp, _ = manual(build_tiny_model(seed=0, initializer_range=0.1).eval(), SHORT_PROMPT, SHORT_RESP, 0.7)
    torch.testing.assert_close(lp1[0, :3].double(), ref_lp, atol=1e-5, rtol=0)
