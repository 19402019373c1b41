"""Host reads (each a device sync on a GPU) in the update's bookkeeping: the per-step sums stay on the device
and are read once (benchmarks/bench_host_syncs.py counts them per RL step: 681 -> 485 on the tiny model, 3
steps; ``float()`` 301 -> 100).

- `UpdateRatio.compute` read two floats per trainable tensor (~800 reads for Qwen3's ~400 tensors); now one.
- `StepStats.add_micro` / `add_gap` read 3-5 floats per micro-batch; now none until `compute`.
- `UpdateMeter.add` read 3 floats per micro-batch; now none until the guard's `flush`.
"""
from __future__ import annotations

import pytest
import torch
from bench_host_syncs import count_step

from fspo.update.guard import UpdateMeter
from fspo.update.stats import StepStats
from fspo.update.update_ratio import UpdateRatio


def _reads(fn):
    counts = []
    out = count_step(fn, counts)()
    return out, counts[0]["host_reads"], counts[0]["aten_ops"]


def test_update_ratio_reads_the_host_once():
    params = [torch.nn.Parameter(torch.full((3,), float(i + 1))) for i in range(50)]
    ratio = UpdateRatio()
    ratio.snapshot(params)
    with torch.no_grad():
        params[0].add_(1.0)
    value, reads, _ = _reads(lambda: ratio.compute(params))
    assert reads == 1  # was 100 (two float() per tensor)
    old2 = sum(3 * (i + 1) ** 2 for i in range(50))
    assert value == pytest.approx((3 * 1.0) ** 0.5 / old2 ** 0.5, rel=1e-12)


def test_step_stats_and_meter_sum_on_the_device():
    stats, meter = StepStats(), UpdateMeter()
    logp, old = torch.tensor([[-1.0, -2.0, -3.0]]), torch.tensor([[-1.0, -1.0, 0.0]])
    mask, ent = torch.tensor([[1, 1, 0]]), torch.tensor([[0.5, 0.25, 9.0]])

    def micro_batches():
        for _ in range(4):
            stats.add_micro(torch.tensor(0.5), logp, old, ent, mask)
            stats.add_gap(logp + 0.1, logp, mask)
            meter.add(torch.tensor([[1.0, 3.0, 100.0]]), logp, old, mask)

    _, reads, _ = _reads(micro_batches)
    assert reads == 0  # was 4 x (3 + 2 + 2 + 3) = 40
    m = stats.compute()
    d = torch.tensor(-1.0)
    assert stats.loss_sum == 2.0 and stats.tokens == 8 and stats.ent_tokens == 8
    assert m["train/entropy"] == pytest.approx(0.375) and m["rollout/logprob_gap"] == pytest.approx(0.1)
    assert m["train/kl"] == pytest.approx(float(torch.exp(d) - 1 - d) / 2)
    meter.flush()
    assert (meter.loss_sum, meter.tokens) == (16.0, 8.0)


def test_count_step_counts_reads_and_ops():
    x = torch.ones(3)
    _, reads, ops = _reads(lambda: (float(x.sum()), bool(x.any()), x.tolist(), int(x[0]), x[1].item()))
    assert reads == 5 and ops >= 4


def test_rank_reduction_includes_the_device_sums(monkeypatch):
    """`reduce_step_stats` (trainer=fsdp) sums the step's accumulators over the ranks; it must read the device
    sums first. Two identical ranks are simulated by a reduce_sum that doubles: every sum doubles. (Without the
    flush the device sums were added after the reduction, once: tests/test_fsdp.py's train/entropy differed.)"""
    from fspo.runtime.launch import distributed

    monkeypatch.setattr(distributed, "reduce_sum", lambda values, device=None: [2 * float(v) for v in values])
    stats = StepStats()
    logp, old = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.0, -1.0]])
    stats.add_micro(torch.tensor(0.5), logp, old, torch.tensor([[0.5, 0.25]]), torch.tensor([[1, 1]]))
    distributed.reduce_step_stats(stats)
    m = stats.compute()
    assert (stats.loss_sum, stats.tokens, stats.ent_tokens) == (1.0, 4.0, 4.0)
    assert m["train/entropy"] == pytest.approx(0.375)
