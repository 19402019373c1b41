"""HFEngine: left padding, EOS-aware response masks, group ids, seeding, RNG isolation, length guard.

To know the completions in advance, `chain_model` turns the tiny Qwen3 into a deterministic
next-token table: every decoder layer's output projections (attention o_proj, MLP down_proj) are
zeroed, so the residual stream at each position is exactly the current token's embedding; the
embedding is one-hot (hidden 128 >= vocab 100) and an untied lm_head maps token x to a logit of
~113 for ``NEXT[x]`` and 0 for every other token. Generation then follows the table whatever the
sampling settings (the runner-up has probability ~e^-113).
"""
from __future__ import annotations

import pytest
import torch

from fspo.models.tiny import build_tiny_model, build_tokenizer
from fspo.rollout.base import SamplingConfig
from fspo.rollout.hf import HFEngine, completion_mask, left_pad

TOK = build_tokenizer()
EOS, PAD = TOK.eos_token_id, TOK.pad_token_id


def ids(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False)["input_ids"]


def tid(ch: str) -> int:
    (i,) = ids(ch)
    return i


# a -> b -> c -> EOS;  x -> x forever (never stops);  every other token -> EOS
NEXT = {tid("a"): tid("b"), tid("b"): tid("c"), tid("c"): EOS, tid("x"): tid("x")}


def chain_model() -> torch.nn.Module:
    model = build_tiny_model(seed=0)
    v, h = model.config.vocab_size, model.config.hidden_size
    assert h >= v
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = torch.zeros(v, h)
        emb[torch.arange(v), torch.arange(v)] = 1.0
        model.model.embed_tokens.weight.copy_(emb)
        head = torch.nn.Linear(h, v, bias=False)  # untied: the table lives in the head only
        head.weight.zero_()
        for x in range(v):
            head.weight[NEXT.get(x, EOS), x] = 10.0  # RMSNorm(one-hot) = sqrt(128) e_x -> logit 113
        model.lm_head = head
    return model


def engine_for(model, batch_size: int = 256, compact: bool = True) -> HFEngine:
    eng = HFEngine(batch_size=batch_size, compact=compact)
    eng.setup(model, TOK, "/nonexistent-unused")
    return eng


def test_chain_model_does_what_the_table_says():
    model = chain_model().eval()
    x = torch.tensor([ids("Q:a")])
    with torch.no_grad():
        logits = model(input_ids=x).logits[0]
    assert logits.argmax(-1).tolist() == [EOS, EOS, tid("b")]  # Q->EOS, :->EOS, a->b
    assert float(logits[-1, tid("b")]) == pytest.approx(10.0 * 128 ** 0.5, rel=1e-4)


def test_left_pad_by_hand():
    got_ids, got_mask = left_pad([[5, 6, 7], [8], []], pad_id=0)
    assert got_ids.tolist() == [[5, 6, 7], [0, 0, 8], [0, 0, 0]]
    assert got_mask.tolist() == [[1, 1, 1], [0, 0, 1], [0, 0, 0]]


def test_completion_mask_by_hand():
    e = 2
    resp = torch.tensor([[5, 6, e, 0, 0],    # EOS at t=2: mask through the EOS
                         [e, 0, 0, 0, 0],    # immediate EOS: length 1
                         [5, 6, 7, 8, 9],    # no EOS: overlong, all 5 tokens count
                         [5, e, 7, e, 9]])   # tokens after the first EOS never count
    mask, overlong = completion_mask(resp, e)
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert overlong.tolist() == [False, False, True, False]


@pytest.mark.parametrize("compact", [True, False])
def test_generate_left_pads_masks_eos_and_flags_overlong(compact):
    eng = engine_for(chain_model(), compact=compact)
    prompts = [ids("Q:a"), ids("QQQ:c"), ids("x")]
    out = eng.generate(prompts, SamplingConfig(n=1, temperature=1.0, max_new_tokens=5, seed=0))
    out.validate()
    # prompts: left-padded to the longest (5 tokens)
    assert out.prompt_ids.tolist() == [[PAD, PAD] + prompts[0], prompts[1], [PAD] * 4 + prompts[2]]
    assert out.prompt_mask.tolist() == [[0, 0, 1, 1, 1], [1] * 5, [0, 0, 0, 0, 1]]
    # responses: a -> "bc</s>", c -> "</s>", x -> "xxxxx" (no EOS in 5 tokens)
    b, c, x = tid("b"), tid("c"), tid("x")
    assert out.response_ids.tolist() == [[b, c, EOS, PAD, PAD], [EOS, PAD, PAD, PAD, PAD], [x] * 5]
    assert out.response_mask.tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1] * 5]
    assert out.lengths.tolist() == [3, 1, 5]
    assert out.overlong.tolist() == [False, False, True]
    assert out.group_ids.tolist() == [0, 1, 2]
    assert TOK.batch_decode(out.response_ids, skip_special_tokens=True) == ["bc", "", "xxxxx"]


@pytest.mark.parametrize("compact", [True, False])
def test_trims_to_longest_completion(compact):
    eng = engine_for(chain_model(), compact=compact)
    out = eng.generate([ids("a"), ids("c")], SamplingConfig(n=1, temperature=0.0, max_new_tokens=50))
    assert out.response_ids.shape == (2, 3)  # generation stops once every row has its EOS
    assert out.lengths.tolist() == [3, 1] and out.overlong.tolist() == [False, False]


@pytest.mark.parametrize("compact", [True, False])
def test_group_ids_and_row_order_for_n_samples(compact):
    eng = engine_for(chain_model(), compact=compact)
    prompts = [ids("Q:a"), ids("c"), ids("Q:x")]
    out = eng.generate(prompts, SamplingConfig(n=3, temperature=1.0, max_new_tokens=4, seed=1))
    assert out.batch_size == 9
    assert out.group_ids.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    for k, p in enumerate(prompts):
        for r in range(3 * k, 3 * k + 3):  # rows k*n .. k*n+n-1 answer prompt k
            assert out.prompt_ids[r][out.prompt_mask[r].bool()].tolist() == p
    assert out.lengths.tolist() == [3] * 3 + [1] * 3 + [4] * 3
    assert out.overlong.tolist() == [False] * 6 + [True] * 3


@pytest.mark.parametrize("compact", [True, False])
def test_generate_batch_size_chunks_give_the_same_batch(compact):
    prompts = [ids("Q:a"), ids("c"), ids("QQQQQ:x"), ids("b")]
    params = SamplingConfig(n=2, temperature=1.0, max_new_tokens=6, seed=3)
    whole = engine_for(chain_model(), batch_size=256, compact=compact).generate(prompts, params)
    # chunks of 3, 3, 2 rows
    chunked = engine_for(chain_model(), batch_size=3, compact=compact).generate(prompts, params)
    for f in ("prompt_ids", "prompt_mask", "response_ids", "response_mask", "group_ids", "overlong"):
        assert torch.equal(getattr(whole, f), getattr(chunked, f)), f


@pytest.mark.parametrize("compact", [True, False])
def test_left_padding_does_not_change_greedy_completion(compact):
    """A random model's greedy completion of a prompt is the same alone and beside a longer prompt
    (left padding + the attention mask keep positions and context intact). initializer_range=0.5
    makes the random model's outputs depend on context (at 0.02 it repeats one token), so this would
    fail if the pads were attended to or shifted the positions."""
    eng = engine_for(build_tiny_model(seed=1, initializer_range=0.5), compact=compact)
    short, long = ids("Q:1+2\nA:"), ids("Q:11+22-33+44\nA:")
    params = SamplingConfig(n=1, temperature=0.0, max_new_tokens=12)
    alone = eng.generate([short], params)
    both = eng.generate([long, short], params)
    t = alone.lengths[0]
    assert len(set(alone.response_ids[0, :t].tolist())) > 3  # the test has power: not one repeated token
    assert both.response_ids[1, :t].tolist() == alone.response_ids[0, :t].tolist()
    assert both.lengths[1] == t


@pytest.mark.parametrize("compact", [True, False])
def test_seeded_sampling_is_reproducible(compact):
    eng = engine_for(build_tiny_model(seed=2), compact=compact)
    prompts = [ids("Q:1+2\nA:"), ids("Q:3-4\nA:")]

    def run(seed):
        return eng.generate(prompts, SamplingConfig(n=4, temperature=1.0, max_new_tokens=16, seed=seed))

    a, b, c = run(11), run(11), run(12)
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.response_mask, b.response_mask)
    assert a.response_ids.shape != c.response_ids.shape or not torch.equal(a.response_ids, c.response_ids)
    # the 4 samples of one prompt differ from each other (sampling, not 4 copies)
    assert len({tuple(r.tolist()) for r in a.response_ids[:4]}) > 1


@pytest.mark.parametrize("seed", [5, None])
def test_generate_leaves_global_rng_untouched(seed):
    eng = engine_for(build_tiny_model(seed=3))
    torch.manual_seed(1234)
    expected = torch.rand(4)
    torch.manual_seed(1234)
    eng.generate([ids("Q:1+2\nA:")], SamplingConfig(n=2, temperature=1.0, max_new_tokens=8, seed=seed))
    assert torch.equal(torch.rand(4), expected)


def test_generate_restores_train_mode():
    model = build_tiny_model(seed=0).train()
    engine_for(model).generate([ids("a")], SamplingConfig(n=1, temperature=0.0, max_new_tokens=2))
    assert model.training


def test_prompt_plus_new_tokens_beyond_max_positions_is_a_clear_error():
    eng = engine_for(build_tiny_model(seed=0, max_position_embeddings=16))
    prompt = ids("Q:12+34\nA:")  # 10 tokens
    assert len(prompt) == 10
    eng.generate([prompt], SamplingConfig(n=1, temperature=0.0, max_new_tokens=6))  # 16: fits exactly
    with pytest.raises(ValueError) as e:
        eng.generate([prompt], SamplingConfig(n=1, temperature=0.0, max_new_tokens=7))
    msg = str(e.value)
    assert "max_position_embeddings" in msg and "max_new_tokens" in msg and "16" in msg


@pytest.mark.parametrize("compact", [True, False])
def test_min_new_tokens_suppresses_eos(compact):
    """min_new_tokens=4: the chain a -> b -> c -> EOS cannot stop before 4 tokens (EOS comes later)."""
    eng = engine_for(chain_model(), compact=compact)
    out = eng.generate([ids("a"), ids("c")], SamplingConfig(n=2, temperature=1.0, max_new_tokens=8,
                                                           min_new_tokens=4, seed=0))
    assert out.lengths.min() >= 4
    assert (out.response_ids[:, :3] != EOS).all()
    with pytest.raises(ValueError, match="min_new_tokens"):
        SamplingConfig(max_new_tokens=8, min_new_tokens=9)


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 5)])
def test_engine_log_probs_are_the_trainers_at_temperature_one(temperature, top_k):
    """The compact decoder reports each sampled token's log-prob under the raw logits (temperature 1,
    no top-k, whatever the sampling settings): the trainer's full-sequence forward gives the same
    numbers to float noise (the KV cache only changes the summation order); 0 on padding."""
    from fspo.models.loading import load_policy
    from fspo.update.logprobs import response_log_probs

    model, tok = load_policy(source="warmstart")
    eng = HFEngine()
    eng.setup(model, tok, "/nonexistent-unused")
    prompts = [tok.encode(p) for p in ["Q:2+7+4-5\nA:", "Q:1+1\nA:", "Q:9-3+8-1+6\nA:"]]
    b = eng.generate(prompts, SamplingConfig(n=4, temperature=temperature, top_k=top_k, max_new_tokens=40,
                                             seed=3))
    assert b.lengths.unique().numel() > 1  # rows ended at different steps
    with torch.no_grad():
        ref, _ = response_log_probs(model, b)
    m = b.response_mask.bool()
    assert (b.engine_log_probs[~m] == 0).all()
    assert (b.engine_log_probs[m] < 0).any()
    assert torch.allclose(b.engine_log_probs, ref, atol=1e-5), float((b.engine_log_probs - ref).abs().max())


def test_generate_path_reports_no_engine_log_probs():
    assert engine_for(chain_model(), compact=False).generate([ids("Q:a")], SamplingConfig(n=1)).engine_log_probs is None
