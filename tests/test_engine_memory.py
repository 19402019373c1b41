"""The trainer/engine memory order around a generation (fspo/rollout/engine_memory.py).

A recording fake engine and a recording ``empty_cache`` show verl's order: gradients dropped and
optimizer state offloaded, cache emptied, engine weights woken, weights synced, cache emptied, KV
cache woken, generation, sleep, cache emptied, optimizer state restored. The real `VLLMEngine`'s
wake/sleep/sync (on a recording stand-in for ``vllm.LLM``, since sleep mode needs a GPU) wakes the
weights alone for the sync and the KV cache only after it. Runs without vLLM and without CUDA.
"""
from __future__ import annotations

import pytest
import torch

from fspo.models.tiny import build_tiny_model
from fspo.rollout import engine_memory
from fspo.rollout.engine_memory import rollout_memory

PARTS = ("weights", "kv_cache")


class RecordingEngine:
    """Records every call; at each call also records whether the trainer's grads were still alive."""

    def __init__(self, log, policy):
        self.log, self.policy = log, policy

    def _grads_alive(self):
        return any(p.grad is not None for p in self.policy.parameters())

    def wake(self, tags=None):
        self.log.append(("wake", tuple(tags) if tags is not None else PARTS, self._grads_alive()))

    def sync_weights(self, model):
        assert model is self.policy
        self.log.append(("sync_weights", self._grads_alive()))

    def sleep(self):
        self.log.append(("sleep",))


def _trained_policy():
    """Tiny policy after one AdamW step: gradients and optimizer state (exp_avg, exp_avg_sq) alive."""
    torch.manual_seed(0)
    policy = build_tiny_model()
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    ids = torch.randint(0, policy.config.vocab_size, (2, 8))
    policy(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    assert all(p.grad is not None for p in policy.parameters() if p.requires_grad)
    return policy, opt


def _recording(monkeypatch, log):
    for name in ("offload_optimizer_state", "restore_optimizer_state"):
        real = getattr(engine_memory, name)

        def wrapped(opt, _real=real, _name=name):
            log.append((_name,))
            _real(opt)
        monkeypatch.setattr(engine_memory, name, wrapped)
    return lambda: log.append(("empty_cache",))


@pytest.mark.parametrize("offload", [False, True])
def test_rollout_memory_follows_verls_order(monkeypatch, offload):
    log = []
    policy, opt = _trained_policy()
    empty = _recording(monkeypatch, log)
    engine = RecordingEngine(log, policy)
    with rollout_memory(engine, policy, [opt], offload_optimizer=offload, empty_cache=empty):
        log.append(("generate",))
    off = [("offload_optimizer_state",)] if offload else []
    back = [("restore_optimizer_state",)] if offload else []
    assert log == off + [
        ("empty_cache",),
        ("wake", ("weights",), False),   # grads already gone when the engine's weights come back
        ("sync_weights", False),
        ("empty_cache",),                # the gathered copies' blocks returned before the KV cache
        ("wake", ("kv_cache",), False),
        ("generate",),
        ("sleep",),
        ("empty_cache",),
    ] + back
    # the optimizer state survived the round trip (values and devices)
    for p in policy.parameters():
        st = opt.state[p]
        assert st["exp_avg"].device == p.device and st["exp_avg"].abs().sum() > 0


def test_rollout_memory_sleeps_and_restores_when_generation_raises(monkeypatch):
    log = []
    policy, opt = _trained_policy()
    empty = _recording(monkeypatch, log)
    with pytest.raises(RuntimeError, match="boom"):
        with rollout_memory(RecordingEngine(log, policy), policy, [opt], offload_optimizer=True, empty_cache=empty):
            raise RuntimeError("boom")
    assert log[-3:] == [("sleep",), ("empty_cache",), ("restore_optimizer_state",)]


def test_offload_moves_state_and_restore_brings_it_back():
    """The state tensors move to CPU and back to the parameter's device with unchanged values; the
    step counter (a scalar) is left alone."""
    policy, opt = _trained_policy()
    before = {id(p): opt.state[p]["exp_avg_sq"].clone() for p in policy.parameters()}
    engine_memory.offload_optimizer_state(opt)
    assert all(opt.state[p]["exp_avg"].device.type == "cpu" for p in policy.parameters())
    engine_memory.restore_optimizer_state(opt)
    for p in policy.parameters():
        assert torch.equal(opt.state[p]["exp_avg_sq"], before[id(p)])


class FakeLLM:
    """Stands in for ``vllm.LLM`` (sleep mode needs CUDA): records sleep / wake_up(tags) / weight reloads."""

    def __init__(self, log):
        self.log = log

    def sleep(self, level=1):
        self.log.append(("llm.sleep", level))

    def wake_up(self, tags=None):
        self.log.append(("llm.wake_up", tuple(tags)))

    def collective_rpc(self, fn):
        log = self.log

        class Worker:
            def reload_weights(self, weights_iterator=None):
                log.append(("llm.reload_weights", sum(1 for _ in weights_iterator)))
        fn(Worker())

    def reset_prefix_cache(self):
        self.log.append(("llm.reset_prefix_cache",))


def test_vllm_engine_wakes_weights_then_kv_cache(monkeypatch):
    """The real VLLMEngine's sleep/wake/sync in rollout_memory on a GPU-like engine: weights woken
    alone for the sync, the KV cache after; two cycles give the same calls."""
    from fspo.rollout.vllm import VLLMEngine

    log = []
    policy, opt = _trained_policy()
    engine = object.__new__(VLLMEngine)  # no vLLM here: the constructor's import is skipped
    engine.llm, engine.on_gpu, engine.enable_sleep_mode = FakeLLM(log), True, True
    engine._asleep, engine._synced, engine.sleep_level = set(), True, 2
    engine.weight_dtype = None  # set by setup(): no cast
    engine.sleep()
    n = len(list(policy.state_dict()))  # tied embeddings: lm_head.weight is in the state dict already
    for _ in range(2):
        del log[:]
        with rollout_memory(engine, policy, [opt], empty_cache=lambda: None):
            assert engine._asleep == set()
        assert log == [("llm.wake_up", ("weights",)), ("llm.reload_weights", n), ("llm.reset_prefix_cache",),
                       ("llm.wake_up", ("kv_cache",)), ("llm.sleep", 2)]
    # outside rollout_memory a sync wakes the weights only, and generate's wake brings the rest
    del log[:]
    engine.sync_weights(policy)
    assert log[0] == ("llm.wake_up", ("weights",)) and engine._asleep == {"kv_cache"}
    engine.wake()
    assert log[-1] == ("llm.wake_up", ("kv_cache",)) and engine._asleep == set()


@pytest.mark.parametrize("level", [1, 2])
def test_vllm_sleep_level_2_discards_the_weights_until_the_next_sync(level):
    """``rollout.engine.sleep_level`` (default 2, as verl and TRL: the weights are re-synced before every
    generation, so level 1's copy to pinned host memory and back is wasted). After a level-2 sleep the
    engine holds no weights: `generate` refuses until `sync_weights`; level 1 keeps them."""
    from fspo.rollout.vllm import VLLMEngine

    log = []
    policy, _ = _trained_policy()
    engine = object.__new__(VLLMEngine)  # no vLLM here: the constructor's import is skipped
    engine.llm, engine.on_gpu, engine.enable_sleep_mode = FakeLLM(log), True, True
    engine._asleep, engine._synced, engine.sleep_level = set(), True, level
    engine.weight_dtype = None  # set by setup(): no cast
    engine.sleep()
    assert log == [("llm.sleep", level)] and engine._synced == (level == 1)
    if level == 2:
        with pytest.raises(RuntimeError, match="call sync_weights"):
            engine.generate([[1, 2]], None)
    engine.sync_weights(policy)
    assert engine._synced


class ShutdownRecorder:
    """The HF engine, recording `shutdown` calls (a class attribute: the run builds its own instance)."""
    calls: list = []

    def __new__(cls, *args, **kwargs):
        from fspo.rollout.hf import HFEngine

        class _Engine(HFEngine):
            def shutdown(self):
                ShutdownRecorder.calls.append("shutdown")
        return _Engine(*args, **kwargs)


@pytest.mark.slow
def test_a_run_shuts_its_engine_down_at_the_end(compose_cfg):
    """vLLM's memory and workers were never freed: `fspo.train.train` now calls ``engine.shutdown()`` once, last."""
    from conftest import SMALL
    from fspo.train import train

    ShutdownRecorder.calls.clear()
    train(compose_cfg([*SMALL, "steps=1", "val.size=0", f"rollout.engine._target_={__name__}.ShutdownRecorder"]))
    assert ShutdownRecorder.calls == ["shutdown"]
