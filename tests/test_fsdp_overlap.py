"""Pipelined rollouts (``rollout.overlap``) under FSDP2 on 2 gloo CPU processes.

``torchrun --standalone --nproc_per_node=2 tests/fsdp_overlap_worker.py`` runs once (module fixture):

- each rank's engine process receives the FULL weights gathered from that rank's shards, exactly
  (start, and a push after every shard moved), and its greedy rollout of that rank's prompts equals
  an unsharded copy's token for token, log-prob for log-prob;
- `fspo.train.train` with ``trainer=fsdp rollout.overlap.enable=true`` runs 3 steps into one MLflow
  run; at step 0 the engines hold the trainer's own weights (log-prob gap at float32 noise), from
  step 1 on the batch is one step stale, which the gap shows.
The layouts that cannot work are refused in tests/test_rollout_overlap.py.
"""
from __future__ import annotations

import pytest
import torch

from conftest import REPO, once_per_session, torchrun_two_ranks

WORKER = REPO / "tests" / "fsdp_overlap_worker.py"
pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return once_per_session(tmp_path_factory, "fsdp_overlap_two_ranks",  # once also when xdist splits this module
                            lambda out: torchrun_two_ranks(WORKER, out, "push,e2e"))


@pytest.mark.parametrize("rank", [0, 1])
def test_each_ranks_engine_gets_the_full_weights_from_the_shards(two_ranks, rank):
    res = torch.load(two_ranks / f"push_rank{rank}.pt", weights_only=False)
    assert res["sharded"]  # the trainer really held shards: half the rows of a q_proj (64 of 128)
    assert res["local_shapes"]["model.layers.0.self_attn.q_proj.weight"] == (64, 128)
    assert res["start_err"] == 0.0 and res["push_err"] == 0.0  # gathered, copied, nothing lost
    assert res["tokens_equal"] and res["n_tokens"] > 0
    assert res["logprob_err"] < 1e-6


def test_train_with_fsdp_and_overlap(two_ranks):
    import mlflow

    client = mlflow.tracking.MlflowClient(f"sqlite:///{two_ranks / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("fspo").experiment_id])
    assert len(runs) == 1  # written by rank 0 only
    rid = runs[0].info.run_id
    gap = {m.step: m.value for m in client.get_metric_history(rid, "rollout/logprob_gap")}
    assert sorted(gap) == [0, 1, 2]
    assert gap[0] < 1e-5 < min(gap[1], gap[2])  # same weights at step 0; one step stale after
    assert len(client.get_metric_history(rid, "reward/mean")) == 3
