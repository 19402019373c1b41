"""``ppo.mini_batch_unit=prompts`` through the real training step (fspo/update/module.py): mini-batches of
whole prompt groups, the same update as ``sequences`` when both cover the same rows, the first
mini-batch's old log-probs from its loss pass; and the data-parallel group ids (fspo/runtime/launch/distributed.py)
that the plan is drawn from before the rollout is gathered.

Drives the module as tests/test_module_update.py does (its `run_update`: a minimal Lightning
Trainer, a hand-built 8-row rollout of 2 groups of 4).
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_module_update import B, make_rollout, run_update

from conftest import free_port
from fspo.models.tiny import build_tiny_model
from fspo.runtime.launch.distributed import gather_group_ids, gather_rollout
from fspo.update.logprobs import response_log_probs
from fspo.update.module import RLModule

G = 4  # make_rollout: group_ids = arange(8) // 4


@pytest.fixture
def recorded(monkeypatch):
    """The group ids of every mini-batch `RLModule._update` receives, in order."""
    seen = []
    original = RLModule._update

    def spy(self, mb, *args, **kwargs):
        seen.append(mb.group_ids.tolist())
        return original(self, mb, *args, **kwargs)

    monkeypatch.setattr(RLModule, "_update", spy)
    return seen


def test_prompt_minibatches_are_whole_groups(recorded):
    _, grads, _ = run_update(make_rollout(), mini_batch_size=1, mini_batch_unit="prompts")
    assert len(grads) == len(recorded) == 2  # 2 groups, 1 per mini-batch
    assert all(len(ids) == G and len(set(ids)) == 1 for ids in recorded)
    assert sorted(ids[0] for ids in recorded) == [0, 1]
    # the module's generator (seed 0, step 0) shuffles the groups
    assert [ids[0] for ids in recorded] == torch.randperm(2, generator=torch.Generator().manual_seed(0)).tolist()


def test_sequence_minibatches_unchanged(recorded):
    """The default unit still shuffles rows: mini-batches of 4 rows from randperm(8) at seed 0."""
    group_ids = make_rollout().group_ids
    want = [group_ids[mb].tolist() for mb in torch.randperm(B, generator=torch.Generator().manual_seed(0)).split(4)]
    run_update(make_rollout(), mini_batch_size=4)
    assert recorded == want


def test_one_prompt_minibatch_of_everything_equals_one_sequence_minibatch():
    """2 prompts x 4 = the 8 sequences: the same single update in either unit (rows in another order)."""
    _, g_seq, m_seq = run_update(make_rollout(), sgd=True, mini_batch_size=B)
    _, g_pr, m_pr = run_update(make_rollout(), sgd=True, mini_batch_size=2, mini_batch_unit="prompts")
    assert len(g_seq) == len(g_pr) == 1
    for name in g_seq[0]:
        torch.testing.assert_close(g_pr[0][name], g_seq[0][name], atol=1e-6, rtol=1e-5, msg=name)
    assert m_pr["train/loss"] == pytest.approx(m_seq["train/loss"], abs=1e-6)


def test_first_group_minibatch_old_log_probs_come_from_its_loss_pass():
    """As in sequences mode: the old-log-prob pass skips the first mini-batch (here a whole group)."""
    fresh = make_rollout()
    fresh.old_log_probs = None
    given = make_rollout()
    with torch.no_grad():
        lp, _ = response_log_probs(build_tiny_model(seed=0), given)
    given.old_log_probs = (lp * given.response_mask).float()
    _, g_fresh, m_fresh = run_update(fresh, sgd=True, mini_batch_size=1, mini_batch_unit="prompts")
    _, g_given, _ = run_update(given, sgd=True, mini_batch_size=1, mini_batch_unit="prompts")
    assert len(g_fresh) == len(g_given) == 2
    for a, b in zip(g_given, g_fresh):
        for name in a:
            torch.testing.assert_close(b[name], a[name], atol=1e-6, rtol=1e-4, msg=name)
    first = int(torch.randperm(2, generator=torch.Generator().manual_seed(0))[0])
    totals = fresh.prompt_mask.sum(-1) + fresh.lengths
    assert m_fresh["perf/old_log_probs_tokens"] == float(totals[fresh.group_ids != first].sum())


# ------------------------------------------------------------------ data parallel group ids
def _worker(rank: int, world: int, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        local = make_rollout(seed=rank).select(torch.arange(4 * (rank + 1)) % B)  # 1 group on rank 0, 2 on rank 1
        ids = gather_group_ids(local.group_ids)
        out[rank] = (ids.tolist(), gather_rollout(local).group_ids.tolist())
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # > 2.5 s: out of the quick loop (-m "not slow"), still in CI
def test_gather_group_ids_matches_gather_rollout():
    """The plan is drawn from `gather_group_ids` before the gather; it must number the groups exactly
    as `gather_rollout` then does (rank order, offset past the previous ranks' groups)."""
    assert gather_group_ids(torch.tensor([0, 0, 1, 1])).tolist() == [0, 0, 1, 1]  # one process: identity
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_worker, args=(2, free_port(), out), nprocs=2, join=True)
        results = dict(out)
    want = [0] * 4 + [1] * 4 + [2] * 4
    for rank in (0, 1):
        assert results[rank][0] == results[rank][1] == want
