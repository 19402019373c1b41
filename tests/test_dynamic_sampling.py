"""Dynamic sampling (fspo/rollout/group_filter.py): the filter on hand-made rewards, rank agreement
over 2 gloo processes, the sampler's extra draws and their resume, a real tiny run's metrics in
MLflow, and kill -9 + ``resume=auto`` against an uninterrupted run.

Owns: the tests of `GroupFilter`, `informative_groups`, `PromptStepSampler.draw` and
`RolloutCallback`'s dynamic-sampling path. The end-to-end runs use `HitReward` (score = fraction of
digits, as test_resume's reward, plus a 0/1 component ``hit``: the completion holds a '7'), so the
random tiny model gives groups whose ``hit`` values are all equal often enough to need extra rounds.
"""
from __future__ import annotations

import os
import random
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import free_port
from fspo.data.sampler import PromptStepSampler
from fspo.rewards.base import RewardOutput
from fspo.rollout.group_filter import GroupFilter, informative_groups
from fspo.runtime.checkpoints.files import list_checkpoints
from fspo.types import RolloutBatch

G = 4


def make_round(group_rewards, width: int = 3, tag: float = 0.0):
    """A scored round: one group per entry of ``group_rewards`` (G rewards each), responses ``width``
    wide holding a row id; rewards and the metric values are the given numbers (+ ``tag`` to tell
    rounds apart in the rewards, not in the metric)."""
    b = len(group_rewards) * G
    vals = [float(x) for grp in group_rewards for x in grp]
    rows = torch.arange(b)
    rollout = RolloutBatch(
        prompt_ids=torch.ones(b, 2, dtype=torch.long), prompt_mask=torch.ones(b, 2, dtype=torch.long),
        response_ids=(rows[:, None] + 100 * int(tag) + 1).repeat(1, width),
        response_mask=torch.ones(b, width, dtype=torch.long),
        rewards=torch.tensor(vals) + tag, group_ids=torch.arange(len(group_rewards)).repeat_interleave(G),
        overlong=torch.zeros(b, dtype=torch.bool), engine_log_probs=torch.zeros(b, width))
    return rollout, vals


MIXED, ZERO, ONE = [0, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]


class Rounds:
    """``more`` for `GroupFilter.run`: hands out the prepared rounds 2, 3, ... and counts the calls."""

    def __init__(self, *rounds):
        self.rounds, self.calls = list(rounds), []

    def __call__(self, j: int):
        self.calls.append(j)
        return self.rounds[j - 1]


def test_informative_groups():
    r, v = make_round([MIXED, ZERO, ONE, [0.5, 0.5, 0.5, 0.25]])
    uniq, keep = informative_groups(torch.tensor(v), r.group_ids)
    assert uniq.tolist() == [0, 1, 2, 3] and keep.tolist() == [True, False, False, True]


def test_all_equal_groups_dropped_mixed_kept_in_one_round():
    first = make_round([MIXED, ZERO, [1, 0, 1, 1], ONE])
    more = Rounds()
    out, m = GroupFilter(True, "score", 3).run(first, more, target=2)
    assert more.calls == [] and m["dynamic_sampling/rounds"] == 1 and m["dynamic_sampling/short"] == 0
    assert m["dynamic_sampling/filtered_frac"] == 0.5 and m["dynamic_sampling/groups"] == 2
    assert out.group_ids.tolist() == [0] * G + [1] * G
    assert out.rewards.tolist() == [0, 1, 0, 0, 1, 0, 1, 1]
    assert out.response_ids[:, 0].tolist() == [1, 2, 3, 4, 9, 10, 11, 12]  # groups 0 and 2 of round 1
    assert out.advantages is None


def test_extra_rounds_until_the_batch_is_full_first_informative_groups_kept():
    first = make_round([ZERO, MIXED, ONE, ZERO], width=3)
    second = make_round([ONE, ZERO, MIXED, ONE], width=5, tag=1)
    third = make_round([MIXED, MIXED, MIXED, ZERO], width=2, tag=2)
    more = Rounds(second, third)
    out, m = GroupFilter(True, "score", 5).run(first, more, target=4)
    assert more.calls == [1, 2]
    assert m["dynamic_sampling/rounds"] == 3 and m["dynamic_sampling/short"] == 0
    assert m["dynamic_sampling/filtered_frac"] == 7 / 12 and m["dynamic_sampling/prompts_drawn"] == 12
    assert m["dynamic_sampling/groups"] == 4
    # round 1 group 1, round 2 group 2, round 3 groups 0 and 1 (its group 2 is surplus), group ids 0..3
    assert out.group_ids.tolist() == [0] * G + [1] * G + [2] * G + [3] * G
    assert out.rewards.tolist() == [0, 1, 0, 0, 1, 2, 1, 1, 2, 3, 2, 2, 2, 3, 2, 2]
    assert out.response_ids.shape[1] == 5  # re-padded to the widest round
    assert out.lengths.tolist() == [3] * G + [5] * G + [2] * 2 * G
    assert out.response_ids[:, 0].tolist() == [5, 6, 7, 8, 109, 110, 111, 112, 201, 202, 203, 204, 205, 206, 207, 208]
    assert (out.response_ids[:, 2:] * (1 - out.response_mask[:, 2:])).abs().sum() == 0
    out.validate()


def test_max_rounds_cap_gives_a_short_step_with_what_there_is():
    first = make_round([ZERO, MIXED, ONE, ZERO])
    more = Rounds(make_round([ONE, ZERO, MIXED, ONE], tag=1), make_round([MIXED] * 4, tag=2))
    out, m = GroupFilter(True, "score", 2).run(first, more, target=4)
    assert more.calls == [1]  # max_rounds=2: the third round is never generated
    assert m["dynamic_sampling/rounds"] == 2 and m["dynamic_sampling/short"] == 1
    assert m["dynamic_sampling/groups"] == 2 and m["dynamic_sampling/filtered_frac"] == 6 / 8
    assert out.batch_size == 2 * G and out.group_ids.tolist() == [0] * G + [1] * G


def test_no_informative_group_trains_one_zero_advantage_group():
    out, m = GroupFilter(True, "score", 1).run(make_round([ZERO, ONE]), Rounds(), target=2)
    assert m["dynamic_sampling/short"] == 1 and m["dynamic_sampling/groups"] == 1
    assert m["dynamic_sampling/filtered_frac"] == 1.0
    assert out.rewards.tolist() == ZERO and out.group_ids.tolist() == [0] * G


def test_metric_choice_and_settings():
    f = GroupFilter(True, "acc", 3)
    assert f.values([0.5, 0.7], {"correct": [0, 1]}) == [0, 1]
    assert f.values([0.5, 0.7], {"format": [1, 1]}) == [0.5, 0.7]  # no `correct`: the reward
    assert GroupFilter(True, "seq_reward").values([0.5], {"correct": [1]}) == [0.5]
    assert GroupFilter(True, "format").values([0.5], {"format": [1]}) == [1]
    with pytest.raises(ValueError, match="no 'hit' component"):
        GroupFilter(True, "hit").values([0.5], {"format": [1]})
    with pytest.raises(ValueError, match="max_rounds must be >= 1"):
        GroupFilter(True, "acc", 0)


def test_sampler_draws_continue_the_stream_and_resume():
    ref = PromptStepSampler(50, 4, 6, seed=3)
    stream = [ref._prompt_at(k) for k in range(24 + 8)]
    s = PromptStepSampler(50, 4, 6, seed=3)
    it = iter(s)
    got = [next(it), s.draw(4), next(it), next(it), s.draw(4)]
    assert sum(got, []) == stream[:20] and s.state_dict() == {"position": 3, "extra": 8}
    r = PromptStepSampler(50, 4, 6, seed=3)
    r.load_state_dict(s.state_dict())
    assert list(r) == list(s) and r.extra == 8
    assert PromptStepSampler(50, 4, 6).state_dict() == {"position": 0}  # no extra: the old format


def test_config_composes_disabled_by_default(compose_cfg):
    from hydra.utils import instantiate

    cfg = compose_cfg()
    f = instantiate(cfg.rollout.dynamic_sampling)
    assert isinstance(f, GroupFilter) and not f.enable and f.metric == "acc" and f.max_rounds == 3
    assert instantiate(compose_cfg(["rollout=vllm",
                                    "rollout.dynamic_sampling.enable=true"]).rollout.dynamic_sampling).enable


# ------------------------------------------------------------------ 2 ranks (gloo)
def _rank_worker(rank: int, port: int, results):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        # rank 0 finds 2 informative groups per round, rank 1 one: they must agree on rounds and counts
        if rank == 0:
            first, later = make_round([MIXED, MIXED, ZERO]), [make_round([MIXED, ZERO, MIXED], tag=1)] * 3
        else:
            first, later = make_round([ZERO, MIXED, ONE]), [make_round([ONE, ONE, MIXED], tag=1)] * 3
        more = Rounds(*later)
        out, m = GroupFilter(True, "score", 3).run(first, more, target=3)
        results[rank] = {"groups": out.batch_size // G, "calls": more.calls, "metrics": m}
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # > 2.5 s: out of the quick loop (-m "not slow"), still in CI
def test_two_ranks_agree_on_rounds_and_groups():
    results = mp.Manager().dict()
    mp.spawn(_rank_worker, args=(free_port(), results), nprocs=2, join=True)
    a, b = results[0], results[1]
    # rank 1 has 1, then 2, then 3 informative groups: 3 rounds; rank 0 had 3 after 2 rounds but follows
    assert a["calls"] == b["calls"] == [1, 2] and a["groups"] == b["groups"] == 3
    assert a["metrics"] == b["metrics"]
    assert a["metrics"]["dynamic_sampling/groups"] == 6 and a["metrics"]["dynamic_sampling/rounds"] == 3
    assert a["metrics"]["dynamic_sampling/filtered_frac"] == pytest.approx(9 / 18)


# ------------------------------------------------------------------ end to end
class HitReward:
    """score = fraction of digits in the completion; component ``hit`` = 1 when it contains a '7'."""

    def __init__(self, **_):
        pass

    def __call__(self, completions, references, lengths, overlong, max_new_tokens) -> RewardOutput:
        s = [sum(c.isdigit() for c in t) / max(len(t), 1) for t in completions]
        return RewardOutput(scores=s, components={"hit": [float("7" in t) for t in completions]})


STEPS, EVERY = 6, 2
DS = ["rollout.dynamic_sampling.enable=true", "rollout.dynamic_sampling.metric=hit",
      "rollout.dynamic_sampling.max_rounds=3", f"reward._target_={__name__}.HitReward"]
RUN_ARGS = ["model.source=random", f"steps={STEPS}", "prompts_per_step=4", "rollout.sampling.n=4",
            "ppo.mini_batch_size=8", "ppo.mini_batch_unit=sequences", "ppo.lr=5e-4",
            "rollout.sampling.max_new_tokens=24", "val.size=8",
            "val.every_n_steps=3", f"checkpoint.every_n_steps={EVERY}", "checkpoint.keep_last=10", "seed=7", *DS]


@pytest.mark.slow
def test_kill9_then_resume_draws_the_same_prompts_and_the_run_logs_the_metrics(tmp_path):
    """As tests/test_resume.py's kill -9 test, with dynamic sampling: the sampler's extra draws are in
    the checkpoint, so the resumed run's parameters and every metric equal the uninterrupted run's. The
    uninterrupted run's MLflow store also holds the dynamic-sampling metrics of every step, consistent with
    each other (one run serves both checks)."""
    from test_resume import NOISY, kill_after_step, metric_rows, policy_state, reference_run, start_run, wait

    seed = int(os.environ.get("FSPO_RESUME_SEED", time.time_ns() % 10_000))
    kill_after = random.Random(seed).randint(EVERY, STEPS - 2)
    why = f"FSPO_RESUME_SEED={seed}: killed after step {kill_after}"
    run = start_run(tmp_path, "killed", args=RUN_ARGS)
    db, out = tmp_path / "killed.db", tmp_path / "killed"
    kill_after_step(run, out, db, kill_after, why, timeout=400)
    done = list_checkpoints(out / "checkpoints")
    assert done and int(done[-1].stem.split("_")[1]) < STEPS, why
    extra = torch.load(done[-1], map_location="cpu", weights_only=False)
    resumed = start_run(tmp_path, "killed", ["resume=auto"], args=RUN_ARGS)
    reference_run(tmp_path, "full", RUN_ARGS)  # the uninterrupted run, in this process, meanwhile
    wait(resumed, tmp_path)

    a = policy_state(tmp_path / "full" / "checkpoints" / f"step_{STEPS:06d}.ckpt")
    b = policy_state(out / "checkpoints" / f"step_{STEPS:06d}.ckpt")
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6, why
    got = {(k, s): v for _, k, s, v in metric_rows(db)}
    want = {(k, s): v for _, k, s, v in metric_rows(tmp_path / "full.db")}
    assert set(got) == set(want), why
    bad = {p: (got[p], want[p]) for p in want if not p[0].startswith(NOISY)
           and abs(got[p] - want[p]) > 1e-6 * max(1.0, abs(want[p]))}
    assert not bad, f"{why}: metrics differ {dict(list(bad.items())[:10])}"
    drawn = {s: v for (k, s), v in want.items() if k == "dynamic_sampling/prompts_drawn"}
    assert any(v > 4 for v in drawn.values()), "no extra round in the reference run: the test shows nothing"
    by = {}
    for (k, s), v in want.items():
        by.setdefault(k, {})[s] = v
    for k in ("filtered_frac", "rounds", "short", "groups", "prompts_drawn"):
        assert set(by[f"dynamic_sampling/{k}"]) == set(range(STEPS)), k
    for s in range(STEPS):
        rounds, groups = by["dynamic_sampling/rounds"][s], by["dynamic_sampling/groups"][s]
        assert 1 <= rounds <= 3 and 1 <= groups <= 4 and 0 <= by["dynamic_sampling/filtered_frac"][s] <= 1
        assert by["dynamic_sampling/short"][s] == float(groups < 4)
        assert by["dynamic_sampling/prompts_drawn"][s] == 4 * rounds
        assert by["train/loss"][s] == by["train/loss"][s]  # trained on each step
    # the checkpoint holds the sampler's extra draws (the prompts of rounds 2+ so far)
    saved = int(done[-1].stem.split("_")[1])
    states = [v for k, v in extra.items() if "DataModule" in k]
    want_extra = int(sum(drawn[s] - 4 for s in range(saved)))
    assert states and states[0]["sampler"].get("extra", 0) == want_extra, why


FSDP_SCRIPT = '''
import json, os, sys
from pathlib import Path
import torch
torch.set_num_threads(1)
from conftest import compose_config
from fspo.train import train

out = Path(sys.argv[1])
cfg = compose_config(sys.argv[2:], output_dir=out / "run", tracking_uri=f"sqlite:///{out / 'mlflow.db'}",
                     artifact_location=out / "artifacts")
final = train(cfg)
if int(os.environ.get("RANK", "0")) == 0:
    (out / "final.json").write_text(json.dumps(final))
torch.distributed.barrier()
torch.distributed.destroy_process_group()
'''


@pytest.mark.distributed
@pytest.mark.slow
def test_fsdp_two_ranks_train_on_the_same_number_of_groups(tmp_path):
    """`fspo.train.train` with trainer=fsdp on 2 gloo processes and dynamic sampling: the run completes
    (unequal group counts would stall FSDP's lockstep passes) and every step trains an even number of
    groups, the same on both ranks; extra rounds happen."""

    import mlflow

    from conftest import REPO, torchrun

    script = tmp_path / "ds_fsdp.py"
    script.write_text(FSDP_SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join([str(REPO / "tests"), str(REPO), os.environ.get("PYTHONPATH", "")]))
    args = ["model.source=random", "trainer=fsdp", "steps=3", "prompts_per_step=4", "rollout.sampling.n=4",
            "ppo.mini_batch_size=8", "ppo.mini_batch_unit=sequences", "rollout.sampling.max_new_tokens=24",
            "val.size=4", "val.batch_size=4",
            "val.every_n_steps=3", "seed=7", *DS]
    torchrun(script, [tmp_path, *args], tmp_path / "logs", cwd=tmp_path, env=env)  # worker logs kept whole
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    from fspo.diagnostics.metric_keys import display_key  # counts are shown in the last chart section

    hist = {k: {m.step: m.value for m in client.get_metric_history(run.info.run_id, display_key(k))}
            for k in ("dynamic_sampling/groups", "dynamic_sampling/rounds", "dynamic_sampling/short",
                      "rollout/n_responses")}
    assert set(hist["dynamic_sampling/groups"]) == {0, 1, 2}
    for s, groups in hist["dynamic_sampling/groups"].items():
        assert groups in (2, 4) and hist["dynamic_sampling/short"][s] == float(groups < 4)
        assert hist["rollout/n_responses"][s] == groups * 4  # the trained batch, over both ranks
    assert max(hist["dynamic_sampling/rounds"].values()) > 1
