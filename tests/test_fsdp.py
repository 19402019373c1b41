"""Sharded data parallel (trainer=fsdp) on 2 CPU processes (gloo) equals one process.

The distributed tests launch ``torchrun --standalone --nproc_per_node=2 tests/fsdp_worker.py`` once
(module fixture) for every scenario; the one-process reference runs in this process. Checked:

- one RL step of the real `RLModule` (FSPO with the EMA band, 2 mini-batches, micro-batches small
  enough that the ranks need zero-weight dummy micro-batches) on a fixed injected rollout, each rank
  holding half of the groups: same loss, same metrics and the same updated parameters (1e-5) as one
  process on all of it; also with activation checkpointing;
- `iter_full_state_dict` (the vLLM weight source) gathers one tensor per yield, lazily;
- a sharded checkpoint (``torch.distributed.checkpoint`` folder, one shard per rank) saved after
  RL step 2 and resumed into a fresh module continues to parameters identical to the uninterrupted run
  (optimizer state, LR schedule, EMA buffers, sampler position and sampling seeds all restored);
- `fspo.train.train` with ``trainer=fsdp``: HF generation in lockstep, validation, MLflow (one run,
  written by rank 0), a sharded checkpoint; the warm start built on meta and loaded shard by shard
  (its checkpoint holds the warm start's weights);
- the sharded checkpoint exported by ``fspo-export`` to a Hugging Face folder with the trainer's log-probs;
- the compact decoder in lockstep (``decode_compact(synced=True)``) on the sharded warm-start model,
  one rank running out of rows before the other: each rank's tokens and engine log-probs equal
  one process decoding that rank's prompts alone.
Plus fast single-process checks of the rank arithmetic and the configs.
"""
from __future__ import annotations

import json

import pytest
import torch

from conftest import REPO, compose_config, once_per_session, torchrun_two_ranks
from fspo.runtime.launch.distributed import FSDP2Strategy, find_layers, gather_rollout, pad_slice, rank_slice
from fspo.update.microbatches import balanced_rank_rows

WORKER = REPO / "tests" / "fsdp_worker.py"
SKIP_TIMING = ("time/", "perf/")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Run every worker scenario on 2 processes; returns the output folder."""
    return once_per_session(tmp_path_factory, "fsdp_two_ranks",  # once also when xdist splits this module
                            lambda out: torchrun_two_ranks(WORKER, out, "step,step_ac,resume,e2e,decode"))


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """The same RL step in this process, on one device without a distributed strategy."""
    import fsdp_worker

    return fsdp_worker.run_step(1, tmp_path_factory.mktemp("fsdp1"))


def _load(path):
    return torch.load(path, weights_only=False)


def _assert_same_step(ref, got):
    moved = max(float((ref["params"][k] - fsdp_init(k)).abs().max()) for k in ref["params"])
    assert moved > 1e-4, "the step did not move the parameters: the comparison would be vacuous"
    # the gradients each optimizer step applies (summed over the ranks): the first update's agree to float
    # noise (1.1e-8 measured, |g| up to 0.05); the second's follow the parameters' difference (6.7e-7)
    assert len(got["grads"]) == len(ref["grads"]) == 2
    for update, atol in ((0, 1e-7), (1, 2e-6)):
        for a, b in zip(ref["grads"][update], got["grads"][update]):
            torch.testing.assert_close(b, a, atol=atol, rtol=0)
    # AdamW's first step is lr * g / (|g| + eps): where |g| < eps = 1e-8 (here -1.8e-9 in layer 1's o_proj)
    # it multiplies the gradient's float noise by lr / eps = 1e5; measured 1.3e-5 in the parameters (2.7e-5
    # with the chunked head, tests/test_fsdp_lm_head.py), against steps of ~lr = 1e-3
    worst = max(float((ref["params"][k] - got["params"][k]).abs().max()) for k in ref["params"])
    assert worst < 5e-5, f"parameters differ by {worst}"
    keys = {k for k in ref["metrics"] if not k.startswith(SKIP_TIMING)}
    assert keys == {k for k in got["metrics"] if not k.startswith(SKIP_TIMING)}
    for k in sorted(keys):
        # a log-ratio is a difference of log-probs after the first update: its error is absolute, at the scale
        # of the parameters' (< 5e-5 above; measured 4.7e-5 on logratio/acf_tau = -2.12 with the chunked head)
        tol = 1e-4 if k.startswith("logratio/") else 1e-6
        assert got["metrics"][k] == pytest.approx(ref["metrics"][k], rel=1e-5, abs=tol), k


def fsdp_init(name):
    """The initial value of parameter ``name`` (the worker's policy: tiny Qwen3, seed 0)."""
    from fspo.models.tiny import build_tiny_model

    if not hasattr(fsdp_init, "sd"):
        fsdp_init.sd = build_tiny_model(seed=0).state_dict()
    return fsdp_init.sd[name]


@pytest.mark.distributed
@pytest.mark.slow
def test_two_ranks_equal_one_process(two_ranks, one_rank):
    got = _load(two_ranks / "step_w2.pt")
    assert got["dummies"] > 0, "the scenario should need dummy micro-batches (uneven counts per rank)"
    assert got["metrics"]["train/updates"] == 2.0
    # ||theta_new - theta_old|| / ||theta_old|| summed over both ranks' shards = one process's
    assert got["metrics"]["train/update_ratio"] > 0
    _assert_same_step(one_rank, got)


@pytest.mark.distributed
@pytest.mark.slow
def test_activation_checkpointing_same_step(two_ranks, one_rank):
    got = _load(two_ranks / "step_w2_ac.pt")
    assert got["grad_ckpt"]
    _assert_same_step(one_rank, got)


@pytest.mark.distributed
@pytest.mark.slow
def test_policy_is_sharded_and_weights_stream_one_tensor_at_a_time(two_ranks):
    got = _load(two_ranks / "step_w2.pt")
    assert got["local_fraction"] == pytest.approx(0.5, abs=0.01)  # each rank holds half of every parameter
    seen = got["gathers_at_yield"]
    assert seen == list(range(1, len(seen) + 1))  # the k-th tensor is gathered when the consumer asks for it


@pytest.mark.distributed
@pytest.mark.slow
def test_sharded_checkpoint_resume_is_exact(two_ranks):
    r = _load(two_ranks / "resume_w2.pt")
    assert {"__0_0.distcp", "__1_0.distcp", "meta.pt", ".metadata"} <= set(r["ckpt_files"])
    assert r["full_step"] == r["resumed_step"] == 3
    assert r["zero_adv_group_frac"] < 1.0  # advantages were not all zero: the steps moved the policy
    for k, v in r["full"].items():
        assert torch.equal(v, r["resumed"][k]), k


@pytest.mark.distributed
@pytest.mark.slow
def test_train_with_trainer_fsdp_end_to_end(two_ranks):
    final = json.loads((two_ranks / "e2e.json").read_text())
    assert final["train/updates"] == 2.0 and "val/accuracy" in final
    assert final["rollout/n_responses"] == 16.0  # 4 prompts x 4 samples, counted over both ranks
    shards = {p.name for p in (two_ranks / "e2e").rglob("__*.distcp")}  # a sharded checkpoint folder
    assert {"__0_0.distcp", "__1_0.distcp"} <= shards
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{two_ranks / 'mlflow.db'}")
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"  # rank 1 opened no run
    # the warm start was built on meta and each rank read its shard (fspo/models/meta_init.py): the
    # checkpoint after 2 steps at lr 2e-5 (Adam: <= 4e-5 per parameter) is the warm start's weights
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from fspo.models.loading import load_policy

    ckpt = sorted((two_ranks / "e2e").rglob("step_*.ckpt"))[-1]
    dcp_to_torch_save(ckpt, two_ranks / "e2e_full.pt")
    saved = torch.load(two_ranks / "e2e_full.pt", weights_only=False)["state_dict"]
    ref, _ = load_policy(source="warmstart")
    for k, v in ref.state_dict().items():
        assert (saved[f"policy.{k}"] - v).abs().max() < 1e-3, k


@pytest.mark.distributed
@pytest.mark.slow
def test_sharded_checkpoint_exports_to_a_hugging_face_folder(two_ranks, tmp_path):
    """fspo-export on the 2-rank run's sharded checkpoint: a folder transformers loads, with the log-probs of
    the trainer's weights as torch's own converter (dcp_to_torch_save) reads them from the shards (rel 1e-5)."""
    from omegaconf import OmegaConf
    from test_hf_export import check_export
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from fspo.runtime.checkpoints.files import read_resume_meta

    ckpt = sorted((two_ranks / "e2e").rglob("step_*.ckpt"))[-1]
    assert ckpt.is_dir() and (ckpt / ".metadata").exists()
    dcp_to_torch_save(ckpt, tmp_path / "full.pt")
    full = torch.load(tmp_path / "full.pt", weights_only=False)["state_dict"]
    state = {k[len("policy."):]: v for k, v in full.items() if k.startswith("policy.")}
    run_cfg = OmegaConf.create(read_resume_meta(ckpt)["run_config"])
    model_cfg = OmegaConf.to_container(run_cfg.model, resolve=True)
    check_export(ckpt, tmp_path / "hf", state, model_cfg, int(run_cfg.get("seed", 0)))


@pytest.mark.distributed
@pytest.mark.slow
def test_synced_compact_decode_equals_one_process(two_ranks):
    from fsdp_worker import DECODE_PROMPTS

    from fspo.models.loading import load_policy
    from fspo.rollout.base import SamplingConfig
    from fspo.rollout.decode import decode_compact
    from fspo.rollout.hf import left_pad

    parts = _load(two_ranks / "decode_w2.pt")
    model, tok = load_policy(source="warmstart")
    model.eval()
    ends = []
    for prompts, (tokens, log_probs) in zip(DECODE_PROMPTS, parts):
        ids, mask = left_pad([tok.encode(p) for p in prompts], tok.pad_token_id)
        ref = decode_compact(model, ids, mask, SamplingConfig(n=1, temperature=0.0, max_new_tokens=60),
                             tok.eos_token_id, tok.pad_token_id)
        assert torch.equal(tokens, ref.tokens)
        assert torch.allclose(log_probs, ref.log_probs, atol=1e-5)
        ends.append(int((tokens == tok.eos_token_id).nonzero()[:, 1].max()))
    assert ends[0] != ends[1]  # one rank ran out of rows first and kept joining the forwards


# ---------------------------------------------------------------- single process
def test_rank_slices_keep_groups_whole():
    assert [rank_slice(8, r, 2) for r in range(2)] == [slice(0, 4), slice(4, 8)]
    with pytest.raises(ValueError, match="prompts_per_step=5 is not divisible"):
        rank_slice(5, 0, 2)
    assert pad_slice(["a", "b", "c"], 1, 2) == (["c", "c"], 1)
    assert pad_slice(["a"], 1, 2) == (["a"], 0)


def test_balanced_rank_rows_hand_computed():
    """Longest row first, to the rank with the fewest tokens (ties: fewer rows, lower rank)."""
    # 10 -> rank 0, 9 -> 1, 2 -> 1 (9 < 10), 1 -> 0 (10 < 11): 11 tokens each; the contiguous halves hold 19 and 3
    assert [balanced_rank_rows(torch.tensor([10, 9, 2, 1]), r, 2).tolist() for r in range(2)] == [[0, 3], [1, 2]]
    # 3 ranks: 5 -> 0, 5 -> 1, 4 -> 2, 3 -> 2 (4), 3 -> 0 (5, 1 row, before rank 1), 2 -> 1 (5), 1 -> 1 (7 = 7, 2 rows
    # each, lower rank): loads 8, 8, 7
    parts = [balanced_rank_rows(torch.tensor([5, 5, 4, 3, 3, 2, 1]), r, 3).tolist() for r in range(3)]
    assert parts == [[0, 4], [1, 5, 6], [2, 3]]
    assert balanced_rank_rows(torch.tensor([4, 2]), 0, 1).tolist() == [0, 1]  # one rank: every row
    assert [balanced_rank_rows(torch.tensor([3]), r, 2).tolist() for r in range(2)] == [[0], []]
    tokens = torch.randint(1, 500, (37,), generator=torch.Generator().manual_seed(0))
    parts = [balanced_rank_rows(tokens, r, 4) for r in range(4)]
    assert sorted(torch.cat(parts).tolist()) == list(range(37))  # every row on exactly one rank
    loads = [int(tokens[p].sum()) for p in parts]
    assert max(loads) - min(loads) <= int(tokens.max())  # the greedy bound


def test_rl_step_gives_each_rank_a_token_balanced_share(monkeypatch, tmp_path):
    """The rows `RLModule` hands rank 0 of 2 in each mini-batch of the worker's step (one process posing as
    rank 0). Mini-batch totals (prompt + response, plan order): [14, 7, 6, 14, 17, 7, 16, 9] and
    [15, 9, 21, 7, 8, 7, 9, 8]; the contiguous halves held 41 | 49 and 52 | 32 tokens. Balanced: 17 -> 0,
    16 -> 1, 14 -> 1, 14 -> 0, 9 -> 1, 7 -> 0, 7 -> 0, 6 -> 1 gives rank 0 rows [1, 3, 4, 5], 45 | 45; and
    21 -> 0, 15 -> 1, 9 -> 1, 9 -> 0, 8 -> 1, 8 -> 0, 7 -> 1, 7 -> 0 gives [2, 5, 6, 7], 45 | 39."""
    import fsdp_worker

    from fspo.update import module as module_file

    seen = []
    plain = module_file.RLModule._update

    def recording(self, mb, *a, rows=None, **k):
        seen.append((mb.prompt_mask.sum(-1) + mb.lengths, rows))
        return plain(self, mb, *a, rows=rows, **k)

    monkeypatch.setattr(module_file, "dp_rank_size", lambda module=None: (0, 2))
    monkeypatch.setattr(module_file.RLModule, "_update", recording)
    cfg = compose_config(fsdp_worker.OVERRIDES, output_dir=tmp_path)
    trainer = fsdp_worker._trainer(cfg, 1, tmp_path, [fsdp_worker.InjectShare(fsdp_worker.fixed_rollout())])
    trainer.fit(fsdp_worker.build_module(cfg), datamodule=fsdp_worker._data(cfg, 1))
    assert [t.tolist() for t, _ in seen] == [[14, 7, 6, 14, 17, 7, 16, 9], [15, 9, 21, 7, 8, 7, 9, 8]]
    assert [rows.tolist() for _, rows in seen] == [[1, 3, 4, 5], [2, 5, 6, 7]]
    assert [int(t[rows].sum()) for t, rows in seen] == [45, 45]  # of 90 and 84 tokens


def test_gather_rollout_is_identity_on_one_process():
    import fsdp_worker

    b = fsdp_worker.fixed_rollout()
    assert gather_rollout(b) is b


def test_find_layers_names_the_choices():
    from fspo.models.tiny import build_tiny_model

    model = build_tiny_model()
    assert len(find_layers(model, "Qwen3DecoderLayer")) == 4 == len(find_layers(model, None))
    with pytest.raises(ValueError, match="Qwen3DecoderLayer"):
        find_layers(model, "LlamaDecoderLayer")


def test_fsdp_trainer_config_composes():
    from hydra.utils import instantiate

    cfg = compose_config(["trainer=fsdp"])
    strategy = instantiate(cfg.trainer.strategy)
    assert isinstance(strategy, FSDP2Strategy)
    assert strategy.sharding.layer_class == "Qwen3DecoderLayer" and strategy.sharding.mixed_precision == "auto"
    with pytest.raises(ValueError, match="mixed_precision"):
        FSDP2Strategy(mixed_precision="int8")


def test_paper_8xh200_config():
    """Table 2 on 8 H200s: 128 prompts x n 16 = 2,048 sequences per step, mini-batch 32 prompts, AdamW
    1e-6, 144 steps, prompt 2,000 / response 18,000 tokens, vLLM memory 0.5 (tests/test_paper_presets.py
    pins the batch reading); 8 FSDP ranks in bf16 with fp32 masters."""
    c = compose_config(["+experiment=paper_8xh200", "+method=fspo"])
    assert c.prompts_per_step == 128 and c.rollout.sampling.n == 16
    assert (c.ppo.mini_batch_size, c.ppo.mini_batch_unit, c.ppo.lr, c.steps) == (32, "prompts", 1e-6, 144)
    assert (c.data.max_prompt_len, c.rollout.sampling.max_new_tokens) == (2000, 18000)
    assert c.rollout.engine.gpu_memory_utilization == 0.5 and c.rollout.engine.tensor_parallel_size == 1
    assert c.trainer.strategy._target_ == "fspo.runtime.launch.distributed.FSDP2Strategy" and c.trainer.devices == 8
    assert c.trainer.strategy.mixed_precision == "bf16" and c.model.dtype == "float32"
    assert c.prompts_per_step % (c.trainer.devices * c.trainer.num_nodes) == 0  # whole groups per rank
