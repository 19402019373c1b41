"""The memory plan's train-phase formulas (fspo/runtime/launch/memory_components.py: activations, logits) against
the bytes the real forward + backward of fspo/update/logprobs.py holds on CPU: the tensors saved for
backward (autograd's saved-tensor hooks, each storage once, parameters left out) for the layers, and the
saved plus temporary bytes at the peak (torch's MemTracker) for the head. The plan must never be below what
is measured (a plan that fits and then runs out of memory is the failure this guards: on an H100 a
Qwen3-1.7B-shaped step planned at 63.5 GiB ran out at 79 GiB with formulas about half of these) and not far
above it.

Measured per layer as the difference between a 4-layer and a 2-layer model (the embedding, the head and
the batch are the same), per head as the difference between two vocabularies."""
from __future__ import annotations

import pytest
import torch

from fspo.models.tiny import build_tiny_model
from fspo.runtime.launch.memory_components import Layout, ModelShape, activation_bytes_per_token, logits
from fspo.types import RolloutBatch
from fspo.update.logprobs import response_log_probs

mem_tracker = pytest.importorskip("torch.distributed._tools.mem_tracker")

B, P, T = 4, 32, 224  # 1,024 tokens, 896 of them response tokens (the head's rows)


def _model_and_batch(layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int, vocab: int):
    torch.manual_seed(0)
    model = build_tiny_model(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                             num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=64,
                             intermediate_size=intermediate, max_position_embeddings=512, tie_word_embeddings=False)
    batch = RolloutBatch(prompt_ids=torch.randint(3, vocab, (B, P)), prompt_mask=torch.ones(B, P, dtype=torch.long),
                         response_ids=torch.randint(3, vocab, (B, T)), response_mask=torch.ones(B, T, dtype=torch.long))
    return model, batch


def _saved(layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int, vocab: int, autocast: bool) -> int:
    """Bytes of the tensors the forward saves for backward (each storage once, parameters left out)."""
    model, batch = _model_and_batch(layers, hidden, heads, kv_heads, intermediate, vocab)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            response_log_probs(model, batch)
    return sum(seen.values())


def _peak(layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int, vocab: int, autocast: bool):
    """(activation bytes, temporary bytes) at the peak of one forward + backward."""
    model, batch = _model_and_batch(layers, hidden, heads, kv_heads, intermediate, vocab)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logp, _ = response_log_probs(model, batch)
        logp.sum().backward()

    step()  # warm-up: lazy buffers (rotary caches) are not the step's
    model.zero_grad(set_to_none=True)
    tracker = mem_tracker.MemTracker()
    tracker.track_external(model)
    with tracker:
        step()
    (peak,) = tracker.get_tracker_snapshot("peak").values()
    by = {str(k).split(".")[-1]: v for k, v in peak.items()}
    return by["ACT"], by["TEMP"]


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "autocast_bf16"])
@pytest.mark.parametrize("hidden,heads,kv_heads,intermediate",
                         [(512, 8, 4, 1536), (512, 8, 4, 3072), (1024, 16, 8, 1536), (512, 16, 4, 1536)])
def test_activation_formula_covers_the_measured_bytes(autocast, hidden, heads, kv_heads, intermediate):
    dims = dict(hidden=hidden, heads=heads, kv_heads=kv_heads, intermediate=intermediate, vocab=1024, autocast=autocast)
    per_layer = (_saved(4, **dims) - _saved(2, **dims)) / 2 / (B * (P + T))
    shape = ModelShape(vocab=1024, hidden=hidden, layers=1, heads=heads, kv_heads=kv_heads, head_dim=64,
                       intermediate=intermediate, tied=False)
    planned = activation_bytes_per_token(shape, Layout(compute_bytes=2 if autocast else 4, autocast=autocast))
    assert per_layer <= planned <= 1.25 * per_layer, (per_layer, planned)
    if not autocast:  # float32: the formula is exact
        assert planned == per_layer


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "autocast_bf16"])
@pytest.mark.slow  # > 2.5 s: out of the quick loop (-m "not slow"), still in CI
def test_dense_head_formula_covers_the_measured_bytes(autocast):
    small, large = (_peak(2, 512, 8, 4, 1536, v, autocast) for v in (8192, 16384))
    per_element = (sum(large) - sum(small)) / (B * T * 8192)  # logits are kept for the response tokens only
    shape = ModelShape(vocab=1, hidden=512, layers=1, heads=8, kv_heads=4, head_dim=64, intermediate=1536, tied=False)
    planned = logits(shape, Layout(compute_bytes=2 if autocast else 4, autocast=autocast, micro_tokens=1))
    assert per_element <= planned <= 1.25 * per_element, (per_element, planned)
