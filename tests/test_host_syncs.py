"""Host reads (each a device sync on a GPU) in the update's bookkeeping: the per-step sums stay on the device
and are read once (benchmarks/bench_host_syncs.py counts them per RL step: 681 -> 485 on the tiny model, 3
steps; ``float()`` 301 -> 100; with ``ppo.mini_batch_unit=sequences`` stated, as the script now does: 492.3 ->
476.7 once the non-finite check below reads the host once per update).

- `UpdateRatio.compute` read two floats per trainable tensor (~800 reads for Qwen3's ~400 tensors); now one.
- `StepStats.add_micro` / `add_gap` read 3-5 floats per micro-batch; now none until `compute`.
- `UpdateMeter.add` read 3 floats per micro-batch; now none until the guard's `flush`.
- `RLModule._update` read ``bool(torch.isfinite(loss))`` per micro-batch; now one ``tolist`` per update.
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
    assert reads == 0  # a read per statistic would be 4 x (3 + 2 + 2 + 3) = 40
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



@pytest.mark.parametrize("budget", [100_000, 24])  # 1 micro-batch per update | 5 and more
def test_update_checks_the_loss_without_a_read_per_micro_batch(monkeypatch, budget):
    """The non-finite check reads the host once per optimizer step (the micro-batches' loss flags, the gradient
    norm's flag and its value, in one ``tolist``), not once per micro-batch: ``bool(torch.isfinite(loss))``
    and ``bool(isfinite(grad_norm))``, ``float(grad_norm)`` made 1 + 1 + 1 reads per update with one micro-batch,
    n + 2 with n. Counted: reads of a tensor made in `RLModule._update` by fspo/update/module.py or
    fspo/runtime/launch/distributed.py (the diagnostics' own reads are left out). The skip is pinned in
    tests/test_module_update.py and tests/test_guard.py."""
    import sys

    from test_module_update import make_rollout, run_update

    from fspo.update.module import RLModule

    reads, FILES = [], ("fspo/update/module.py", "fspo/runtime/launch/distributed.py")
    for name in ("__bool__", "__float__", "item", "tolist"):
        orig = getattr(torch.Tensor, name)

        def counting(self, *a, _orig=orig, _name=name, **k):
            if updates and updates[-1] and sys._getframe(1).f_code.co_filename.endswith(FILES):
                reads.append(_name)
            return _orig(self, *a, **k)
        monkeypatch.setattr(torch.Tensor, name, counting)
    updates, plain = [], RLModule._update

    def update(*a, **k):  # reads are counted inside the update only
        updates.append(True)
        try:
            return plain(*a, **k)
        finally:
            updates[-1] = False
    monkeypatch.setattr(RLModule, "_update", update)
    run_update(make_rollout(), micro_batch_max_tokens=budget)
    assert len(updates) == 2  # 8 sequences / mini-batches of 4
    assert sorted(reads) == ["tolist", "tolist"]  # one per update, whatever the micro-batch count


def test_skipped_update_records_only_the_micro_batches_before_the_nonfinite_one():
    """A NaN old log-prob in row 3, the 4th of 5 micro-batches ([1], [6], [5], [3, 0], [2, 7, 4] at budget 24):
    the update is skipped and its statistics hold the first 3 micro-batches only, as when the loop stopped at
    the non-finite loss (measured: all 48 logged values equal that loop's); none of them is NaN, which a
    flag checked after recording every micro-batch would have let into train/loss and the diagnostics."""
    import math

    from test_module_update import make_rollout, run_update

    rollout = make_rollout()
    rollout.old_log_probs[3, 2] = float("nan")
    module, grads, metrics = run_update(rollout, mini_batch_size=8, nonfinite="skip", micro_batch_max_tokens=24)
    assert grads == [] and int(module.skipped_updates) == 1 and metrics["train/updates"] == 0.0
    assert [k for k, v in metrics.items() if not math.isfinite(v)] == []
    assert metrics["train/loss"] != 0.0  # the 3 finite micro-batches were recorded
