"""The chunked LM head (``ppo.lm_head_chunk_rows``) under FSDP2 (trainer=fsdp) equals the dense head.

The distributed tests launch ``torchrun --standalone --nproc_per_node=2 tests/fsdp_head_worker.py``
once (module fixture, gloo on CPU). Checked, for tied and untied embeddings and the padded, one-row
segment and packed-rows layouts:

- under FSDP the chunked head's log-probs, entropies, no-grad (old) log-probs and every parameter's
  gradient (summed over the ranks) equal the dense head's under FSDP (float32; and with FSDP2's bf16
  mixed precision up to bf16 rounding);
- the sharded chunked values equal one unsharded process on the whole batch;
- one RL step of the real `RLModule` with trainer=fsdp and the chunked head equals one process
  (parameters and metrics).

Run outside the root module's forward, the body and head would see ungathered sharded parameters and
fail with "aten.embedding.default got mixed torch.Tensor and DTensor"; `in_root_forward` prevents that.
Plus a ``gpu`` test: the same comparison on CUDA with NCCL and bf16 compute (skipped without a GPU), and
single-process checks of `in_root_forward` and the config.
"""
from __future__ import annotations

import pytest
import torch
from test_fsdp import _assert_same_step

from conftest import REPO, once_per_session, torchrun

WORKER = REPO / "tests" / "fsdp_head_worker.py"
import fsdp_head_worker as hw  # noqa: E402  (tests/ is on pytest's path, as conftest)

CASES = [(tied, layout) for tied in (True, False) for layout in hw.LAYOUTS]


def _torchrun(out, nproc: int, args) -> None:
    torchrun(WORKER, [out, *args], out / "logs", nproc=nproc)  # worker logs kept whole (tests/conftest.py)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return once_per_session(tmp_path_factory, "fsdp_head_two_ranks",  # once also when xdist splits this module
                            lambda out: _torchrun(out, 2, ["step,head,head_bf16", "cpu", "none"]))


def _load(path):
    return torch.load(path, weights_only=False)


def _joined(parts, width):
    """The ranks' [b_r, t_r] results as one [B, width] tensor in global row order."""
    return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts])


def _assert_grads_close(got, ref, atol, rtol):
    assert got.keys() == ref.keys() and ref
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], atol=atol, rtol=rtol, msg=n)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("tied,layout", CASES)
def test_chunked_head_under_fsdp_equals_dense(two_ranks, tied, layout):
    res = _load(two_ranks / "head_w2_cpu_none.pt")
    dense, chunked = res[(tied, layout, 0)], res[(tied, layout, hw.CHUNK)]
    assert dense["sharded"] and chunked["sharded"]  # every parameter, the head's included, is a DTensor shard
    for key in ("logp", "ent", "old"):
        for d, c in zip(dense[key], chunked[key]):
            torch.testing.assert_close(c, d, atol=1e-5, rtol=0, msg=key)
    head = "model.embed_tokens.weight" if tied else "lm_head.weight"
    assert float(dense["grads"][head].abs().sum()) > 0 and ("lm_head.weight" in dense["grads"]) == (not tied)
    _assert_grads_close(chunked["grads"], dense["grads"], atol=1e-4, rtol=1e-5)  # |g| up to ~26


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("tied,layout", CASES)
def test_chunked_head_under_fsdp_equals_one_process(two_ranks, tied, layout):
    sharded = _load(two_ranks / "head_w2_cpu_none.pt")[(tied, layout, hw.CHUNK)]
    full = hw.fsdp_worker.fixed_rollout()
    ref = hw.log_probs_and_grads(hw.build_model(tied), full, layout, hw.CHUNK, torch.device("cpu"),
                                 torch.arange(full.batch_size))
    t = full.response_ids.shape[1]
    for key in ("logp", "ent", "old"):
        torch.testing.assert_close(_joined(sharded[key], t), ref[key], atol=1e-5, rtol=0, msg=key)
    _assert_grads_close(sharded["grads"], ref["grads"], atol=1e-4, rtol=1e-5)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("tied,layout", CASES)
def test_chunked_head_under_fsdp_bf16_compute_equals_dense(two_ranks, tied, layout):
    """FSDP2 bf16 mixed precision: both heads see the same bf16 hidden states and weight; measured on
    CPU: log-probs identical, gradients within 0.3% (relative norm), cosine > 0.99999."""
    res = _load(two_ranks / "head_w2_cpu_bf16.pt")
    _assert_bf16_close(res[(tied, layout, 0)], res[(tied, layout, hw.CHUNK)])


def _assert_bf16_close(dense, chunked, lp_atol=1e-5):
    for key in ("logp", "ent", "old"):
        for d, c in zip(dense[key], chunked[key]):
            assert d.dtype == c.dtype == torch.float32
            torch.testing.assert_close(c, d, atol=lp_atol, rtol=0, msg=key)
    assert dense["grads"].keys() == chunked["grads"].keys()
    for n, g in dense["grads"].items():
        c = chunked["grads"][n]
        assert float((c - g).norm()) <= 0.02 * float(g.norm()), n
        assert float(torch.nn.functional.cosine_similarity(c.flatten(), g.flatten(), dim=0)) > 0.999, n


@pytest.mark.distributed
@pytest.mark.slow
def test_rl_step_with_chunked_head_under_fsdp_equals_one_process(two_ranks, tmp_path):
    """The same step on one process with the chunked head (with the dense head the log-probs differ at
    float noise, <= 1e-6, which the first AdamW step at lr 1e-3 amplifies to 7e-5 in the parameters:
    measured; values and gradients of both heads are pinned above)."""
    got = _load(two_ranks / "step_w2_chunk.pt")
    ref = hw.fsdp_worker.run_step(1, tmp_path, [f"ppo.lm_head_chunk_rows={hw.CHUNK}"])
    assert got["dummies"] > 0  # the ranks ran different micro-batch counts: zero-weight dummies kept them in step
    _assert_same_step(ref, got)  # gradients, parameters and metrics (tests/test_fsdp.py)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_chunked_head_under_fsdp_on_cuda_equals_dense(tmp_path):
    """FSDP2 on CUDA (NCCL, bf16 compute with fp32 masters: mixed_precision auto) on
    min(2, GPUs) ranks; the chunked head equals the dense one. cuBLAS may round the [K, V] and the
    chunk's bf16 logits differently, so log-probs are compared at bf16 resolution."""
    n = min(2, torch.cuda.device_count())
    _torchrun(tmp_path, n, ["head", "cuda", "auto"])
    res = _load(tmp_path / f"head_w{n}_cuda_auto.pt")
    for tied, layout in CASES:
        dense, chunked = res[(tied, layout, 0)], res[(tied, layout, hw.CHUNK)]
        assert dense["sharded"] and chunked["sharded"]
        _assert_bf16_close(dense, chunked, lp_atol=0.1)
        for d, c in zip(dense["logp"], chunked["logp"]):
            assert float((c - d).abs().mean()) < 1e-2


# ---------------------------------------------------------------- single process
def test_in_root_forward_runs_the_root_hooks_and_restores_forward():
    from fspo.models.tiny import build_tiny_model
    from fspo.update.logprobs import in_root_forward

    model = build_tiny_model()
    seen = []
    model.register_forward_pre_hook(lambda m, a: seen.append(("pre", len(a))))
    model.register_forward_hook(lambda m, a, o: seen.append("post"))
    x = torch.tensor([[5, 6]])
    assert in_root_forward(model, lambda ids, k=0: seen.append(("fn", ids is x, k)) or 7, x, k=2) == 7
    assert seen == [("pre", 1), ("fn", True, 2), "post"] and "forward" not in vars(model)
    with pytest.raises(ZeroDivisionError):
        in_root_forward(model, lambda ids: 1 / 0, x)
    assert "forward" not in vars(model)  # the class's forward is back after an error too
    with pytest.raises(ValueError, match="positional input"):
        in_root_forward(model, lambda: 3)  # the root is never called without inputs
    assert model(input_ids=torch.tensor([[5, 6]])).logits.shape == (1, 2, model.config.vocab_size)
    wrapped = model.forward  # an instance-level forward, as some wrappers install, survives the call
    model.forward = wrapped
    assert in_root_forward(model, lambda ids: 3, x) == 3 and vars(model)["forward"] is wrapped


def _fsdp_cuda_root_pre_forward(module, args, kwargs):
    """What FSDP2's root pre-forward does with the inputs on CUDA in torch < 2.13 (``_fsdp_state.py``:
    ``_to_kwargs`` then ``args_tuple[0]``, with no guard for a call without inputs; pytorch#183943)."""
    from torch.distributed.utils import _to_kwargs

    args_tuple, kwargs_tuple = _to_kwargs(args, kwargs, torch.device("cpu"), False)
    return args_tuple[0], kwargs_tuple[0]


@pytest.mark.parametrize("layout", list(hw.LAYOUTS))
def test_chunked_head_calls_the_root_with_inputs_as_fsdp_on_cuda_needs(layout):
    """The chunked head runs inside the root's forward call; FSDP2's root pre-forward on CUDA (torch < 2.13)
    indexes the moved inputs, so a call with none raised IndexError (every ppo.lm_head_chunk_rows > 0 run
    under trainer=fsdp on a GPU). Here that pre-forward is replayed on CPU: every root call gets inputs
    and the chunked log-probs equal the dense ones."""
    from fspo.models.segment_attention import enable_segment_attention
    from fspo.update.logprobs import response_log_probs

    model = hw.build_model(False)
    if layout == "segment":
        enable_segment_attention(model)
    calls = []
    model.register_forward_pre_hook(lambda m, a, k: calls.append(len(a) + len(k)), with_kwargs=True)
    model.register_forward_pre_hook(_fsdp_cuda_root_pre_forward, with_kwargs=True)
    batch = hw.fsdp_worker.fixed_rollout()
    dense, _ = response_log_probs(model, batch, pack_width=hw.LAYOUTS[layout])
    chunked, _ = response_log_probs(model, batch, pack_width=hw.LAYOUTS[layout], head_chunk_rows=hw.CHUNK)
    torch.testing.assert_close(chunked, dense, atol=1e-5, rtol=0)
    assert calls and min(calls) >= 1


def test_chunked_head_is_accepted_under_fsdp():
    from omegaconf import OmegaConf

    from fspo.runtime.checks.config_check import _cross_checks

    cfg = OmegaConf.create({"ppo": {"lm_head_chunk_rows": 512},
                            "trainer": {"strategy": {"_target_": "fspo.runtime.launch.distributed.FSDP2Strategy"}}})
    _cross_checks(cfg, [])  # no ConfigError
