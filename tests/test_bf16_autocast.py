"""``ppo.autocast=bf16``: the forward passes under torch.autocast(bfloat16) with float32 master weights.

Checks that the log-probs stay float32 and close to the float32 pass (the rounding gap is bounded, and
not zero: bf16 really ran), that gradients reach the float32 parameters as float32, and the settings
PPOConfig refuses (engine log-probs; the chunked head).
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_logprobs import LONG_PROMPT, LONG_RESP, SHORT_PROMPT, SHORT_RESP, batch_of

from fspo.models.tiny import build_tiny_model
from fspo.update import forward
from fspo.update.settings import PPOConfig


def _module(model, autocast):
    ppo = SimpleNamespace(logprob_temperature=1.0, lm_head_chunk_rows=0, autocast=autocast)
    return SimpleNamespace(policy=model, ppo=ppo)


def test_bf16_log_probs_are_float32_close_to_fp32_and_differ_by_rounding():
    model = build_tiny_model(seed=0, initializer_range=0.1)
    batch = batch_of([(SHORT_PROMPT, SHORT_RESP), (LONG_PROMPT, LONG_RESP)])
    ref, _ = forward.log_probs(_module(model, None), batch)
    lp, _ = forward.log_probs(_module(model, "bf16"), batch)
    mask = batch.response_mask.bool()
    gap = (lp - ref)[mask].abs()
    assert lp.dtype == torch.float32 and next(model.parameters()).dtype == torch.float32
    assert 0 < float(gap.max()) < 0.1 and float(gap.mean()) < 0.03  # bf16 has 8 mantissa bits: ~1e-2 on log-probs


def test_bf16_gradients_reach_the_float32_parameters():
    model = build_tiny_model(seed=0, initializer_range=0.1)
    lp, _ = forward.log_probs(_module(model, "bf16"), batch_of([(SHORT_PROMPT, SHORT_RESP)]))
    lp.sum().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)
    assert sum(float(g.abs().sum()) for g in grads) > 0


@pytest.mark.parametrize("kw, match", [
    (dict(autocast="fp8"), "ppo.autocast must be null or 'bf16'"),
    (dict(autocast="bf16", old_log_probs="engine"), "set ppo.old_log_probs=recompute"),
])
def test_bf16_settings_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        PPOConfig(**kw)
    PPOConfig(autocast="bf16", old_log_probs="recompute")  # the supported combination
    PPOConfig(autocast="bf16", old_log_probs="recompute", lm_head_chunk_rows=64)  # with the chunked head too


def test_chunked_head_under_bf16_autocast_equals_the_dense_head():
    """ppo.autocast=bf16 with ppo.lm_head_chunk_rows > 0 (refused before: the chunks ran their matmul in bf16
    forward but recomputed it in float32 in backward). Both heads see the same bf16 product: log-probs equal
    to float noise, gradients of the float32 parameters (float32) within 0.2% of the dense ones."""
    batch = batch_of([(SHORT_PROMPT, SHORT_RESP), (LONG_PROMPT, LONG_RESP)])
    out = {}
    for chunk in (0, 3):
        model = build_tiny_model(seed=0, initializer_range=0.1)
        module = _module(model, "bf16")
        module.ppo.lm_head_chunk_rows = chunk
        lp, _ = forward.log_probs(module, batch)
        (lp * torch.linspace(-1, 1, lp.numel()).reshape(lp.shape)).sum().backward()
        out[chunk] = lp.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    (dense, gd), (chunked, gc) = out[0], out[3]
    torch.testing.assert_close(chunked, dense, atol=1e-6, rtol=0)  # measured: identical
    assert gd.keys() == gc.keys() and "model.embed_tokens.weight" in gc  # tied: the head's gradient too
    for n, g in gd.items():
        assert gc[n].dtype == torch.float32
        # measured: 7.2e-4 relative; 9.3e-3 when backward recomputed the logits in float32 (autocast off there)
        assert float((gc[n] - g).norm()) <= 2e-3 * float(g.norm()), n
