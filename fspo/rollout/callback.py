"""The rollout callback: turns each batch of prompts into a scored rollout batch before the step runs.

``on_train_batch_start``: sync weights -> generate G completions per prompt -> decode -> reward -> advantages,
stored as ``batch["rollout"]``, ``batch["rollout_metrics"]`` and ``batch["rollout_timings"]``; with
``rollout.overlap`` the rollouts come from the pipeline, with ``rollout.dynamic_sampling`` uninformative groups
are replaced (round j >= 1 seeded by `round_seed`). Validation generates in-process into ``batch["val_stats"]``.
Seeds: step k `step_seed` ``(seed, k, rank)``, validation batch j `val_seed` ``(seed, j, rank)``. Each rank
generates its contiguous slice of whole groups; reward metrics are sums over ranks.
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Dict, List, Optional

import lightning as L
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException

from fspo.rewards.base import RewardOutput
from fspo.rewards.guard import check_reward_health, guarded_reward, reward_name
from fspo.rollout.base import RolloutEngine, SamplingConfig
from fspo.rollout.engine_memory import rollout_memory
from fspo.rollout.group_filter import GroupFilter, informative_groups
from fspo.rollout.pipeline import RolloutPipeline
from fspo.runtime.checkpoints.resume_state import rng_states, set_rng_states
from fspo.runtime.checkpoints.stop_signal import (
    StepInterrupted,
    agree_stop,
    interruptible,
    rewind_to_last_step_end,
    synced_stops,
)
from fspo.runtime.launch.distributed import attached_trainer, dp_rank_size, pad_slice, rank_slice, reduce_sum
from fspo.seeds import round_seed, step_seed, val_seed
from fspo.types import RolloutBatch

log = logging.getLogger(__name__)


def _datamodule_sampler(trainer, method: str, key: str, why: str):
    """(datamodule, its prompt sampler), refused unless the sampler has ``method`` (what ``key`` needs)."""
    dm = getattr(trainer, "datamodule", None)
    sampler = getattr(dm, "sampler", None)
    if sampler is None or not hasattr(sampler, method):
        raise RuntimeError(f"{key} needs the trainer's datamodule to be a fspo.data.datamodule.PromptDataModule "
                           f"(it {why})")
    return dm, sampler


class RolloutCallback(L.Callback):
    """Drives the rollout engine; ``max_prompt_len`` bounds prompt tokens."""

    def __init__(self, engine: RolloutEngine, tokenizer, reward_fn, advantage_fn: Callable,
                 sampling: SamplingConfig, val_sampling: SamplingConfig, max_prompt_len: int = 1024,
                 seed: int = 0, group_filter: Optional[GroupFilter] = None,
                 pipeline: Optional[RolloutPipeline] = None, max_reward_error_frac: float = 0.0,
                 advantage_mask: Optional[Callable] = None):
        self.engine = engine
        self.max_reward_error_frac = float(max_reward_error_frac)  # reward_guard.max_error_frac
        self.group_filter = group_filter if group_filter is not None and group_filter.enable else None
        self.tokenizer = tokenizer
        self.reward_fn = reward_fn
        self.advantage_fn = advantage_fn
        self.sampling = sampling
        self.val_sampling = val_sampling
        self.max_prompt_len = max_prompt_len
        self.seed = seed
        self.pipeline = pipeline  # rollout.overlap: training rollouts from an engine process, k steps ahead
        self.advantage_mask = advantage_mask  # (lengths, group_ids) -> [B] multiplier
        self._ready = False

    def _advantages(self, rollout: RolloutBatch, rewards: torch.Tensor) -> torch.Tensor:
        adv = self.advantage_fn(rewards, rollout.group_ids).float()
        if self.advantage_mask is not None:
            adv = adv * self.advantage_mask(rollout.lengths, rollout.group_ids).to(adv.device)
        return adv

    def setup(self, trainer, pl_module, stage):
        self._workdir = Path(trainer.default_root_dir) / "engine"

    def _ensure_engine(self, pl_module) -> None:
        # at first use: the strategy shards the policy after the callbacks' setup, and the engine must see it
        if not self._ready:
            self._workdir.mkdir(parents=True, exist_ok=True)
            trainer = attached_trainer(pl_module)
            if trainer is not None and hasattr(self.engine, "trainer_local_rank"):
                self.engine.trainer_local_rank = trainer.local_rank  # Lightning's cluster environment
            self.engine.setup(pl_module.policy, self.tokenizer, str(self._workdir))
            self._ready = True

    def _tokenize(self, prompts: List[str]) -> List[List[int]]:
        ids = self.tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
        longest = max((len(x) for x in ids), default=0)
        if longest > self.max_prompt_len:
            new = self.sampling.max_new_tokens
            ctx = getattr(getattr(getattr(self.engine, "model", None), "config", None), "max_position_embeddings", None)
            head = f"a prompt has {longest} tokens but data.max_prompt_len is {self.max_prompt_len}: "
            if isinstance(ctx, int) and longest + new > ctx:  # raising max_prompt_len alone would not fit
                raise ValueError(head + (f"set data.max_prompt_len={longest} and rollout.sampling.max_new_tokens="
                                         f"{ctx - longest} (the model's context is {ctx} tokens)" if ctx - longest >= 1
                                         else f"the prompt alone exceeds the model's context of {ctx} tokens")
                                 + f", or remove prompts over {min(self.max_prompt_len, max(ctx - new, 1))} tokens "
                                   f"from the data")
            raise ValueError(head + f"set data.max_prompt_len={longest}"
                             + (f" (it fits the model's context: {longest} + {new} new tokens <= {ctx})" if ctx else
                                f", or remove prompts over {self.max_prompt_len} tokens from the data"))
        return ids

    def _generate(self, pl_module, prompts: List[str], params: SamplingConfig,
                  timings: Dict[str, float]) -> RolloutBatch:
        self._ensure_engine(pl_module)
        trainer = attached_trainer(pl_module)
        optimizers = trainer.optimizers if trainer is not None else []
        t0 = time.perf_counter()
        with rollout_memory(self.engine, pl_module.policy, optimizers,
                            offload_optimizer=bool(getattr(self.engine, "offload_optimizer", False))):
            t1 = time.perf_counter()
            rollout = self.engine.generate(self._tokenize(prompts), params)
        t2 = time.perf_counter()
        timings["time/weight_sync"] = t1 - t0
        timings["time/generate"] = t2 - t1
        return rollout.to(pl_module.device)

    def _score(self, rollout: RolloutBatch, answers: List[str], params: SamplingConfig):
        texts = self.tokenizer.batch_decode(rollout.response_ids, skip_special_tokens=True)
        refs = [answers[int(g)] for g in rollout.group_ids]
        return guarded_reward(self.reward_fn, texts, refs, rollout.lengths.tolist(), rollout.overlong.tolist(),
                              params.max_new_tokens)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        step = int(pl_module.rl_step)
        rank, world = dp_rank_size(pl_module)
        part = rank_slice(len(batch["prompts"]), rank, world)
        prompts, answers = batch["prompts"][part], batch["answers"][part]
        params = replace(self.sampling, seed=step_seed(self.seed, step, rank))
        timings: Dict[str, float] = {}
        before, interrupted = rng_states(), False  # a stop signal until the scores are in abandons this step
        try:
            if self.pipeline is not None:
                rollout = self._take_pipelined(trainer, pl_module, step, prompts, timings)
            else:  # several ranks: collectives, cut only at the synced decoder's per-token agreement
                with interruptible() if world == 1 else synced_stops():
                    rollout = self._generate(pl_module, prompts, params, timings)
            t0 = time.perf_counter()
            with interruptible():  # the reward: rank-local by contract
                out = self._score(rollout, answers, params)
        except StepInterrupted:
            interrupted = True
        if agree_stop(interrupted, pl_module.device):  # every rank: the same decision
            self._abandon_step(trainer, step, before)
        rewards = torch.tensor(out.scores, dtype=torch.float32, device=rollout.response_ids.device)
        rollout.rewards = rewards
        rollout.advantages = self._advantages(rollout, rewards)
        timings["time/reward"] = time.perf_counter() - t0
        # fraction of prompts whose G rewards are all equal (zero advantage: no learning signal)
        _, informative = informative_groups(rewards.cpu(), rollout.group_ids.cpu())
        n_groups, zero_adv = len(informative), float((~informative).sum())
        names = sorted(out.components)
        sums = reduce_sum([rewards.sum(), len(rewards), out.errors, zero_adv, n_groups]
                          + [x for k in names for x in (sum(out.components[k]), len(out.components[k]))],
                          pl_module.device)  # exact over data-parallel ranks
        metrics: Dict[str, float] = {"reward/mean": sums[0] / max(sums[1], 1), "reward/errors": sums[2]}
        for i, name in enumerate(names):
            metrics[f"reward/{name}"] = sums[5 + 2 * i] / max(sums[6 + 2 * i], 1)
        total = {name: sums[5 + 2 * i] for i, name in enumerate(names)}  # the same on every rank: all stop together
        check_reward_health(reward_name(self.reward_fn), step, sums[1], total.get("nonfinite", 0.0),
                            total.get("raised", 0.0), sums[2], self.max_reward_error_frac)
        if sums[4]:
            metrics["reward/zero_adv_group_frac"] = sums[3] / sums[4]
        if self.group_filter is not None:  # dynamic sampling: the kept groups, their advantages
            rollout, ds = self._filter_groups(trainer, pl_module, rollout, out, params, len(prompts), timings)
            metrics.update(ds)
        batch["rollout"] = rollout
        batch["policy_lag"] = self.pipeline.lag if self.pipeline is not None else 0  # steps behind the trainer
        batch["rollout_metrics"] = metrics
        batch["rollout_timings"] = timings

    def _take_pipelined(self, trainer, pl_module, step: int, prompts: List[str], timings: Dict[str, float]):
        """Step ``step``'s rollout from the pipeline, which asks the sampler for the prompts of steps ahead (this
        rank's slice and seed); they must be the ones Lightning gives."""
        dm, sampler = _datamodule_sampler(trainer, "step_prompts", "rollout.overlap",
                                          "reads the prompts of steps ahead")
        self.pipeline.engine.should_stop = lambda: bool(trainer.received_sigterm)  # SIGTERM ends a wait
        self.pipeline.start(pl_module.policy, self.tokenizer)
        rank, world = dp_rank_size(pl_module)

        def mine(s: int):  # this rank's share of step s's prompts, as in the in-process path
            idx = sampler.step_prompts(s)
            return idx[rank_slice(len(idx), rank, world)]

        def request(s: int):
            items = [dm.train_source[i] for i in mine(s)]
            return self._tokenize([x.prompt for x in items]), replace(self.sampling, seed=step_seed(self.seed, s, rank))

        ahead = [dm.train_source[i].prompt for i in mine(step)]
        if list(ahead) != list(prompts):
            raise RuntimeError(f"rollout.overlap: step {step}'s prompts from the sampler differ from the batch's")
        try:
            batch = self.pipeline.take(step, int(sampler.steps) - 1, pl_module.policy, request, timings)
            return batch.to(pl_module.device)
        except SIGTERMException:  # a stop signal while waiting: this step does not run, the checkpoint resumes at it
            sampler.position = step
            raise

    @staticmethod
    def _abandon_step(trainer, step: int, rng_before) -> None:
        """A stop signal before this step's update: put back the sampler and the RNG as at the step's start, and
        stop (the checkpoint then written is step ``step``, the last completed one)."""
        sampler = getattr(getattr(trainer, "datamodule", None), "sampler", None)
        if sampler is not None and hasattr(sampler, "position"):
            sampler.position = step
        set_rng_states(rng_before)
        rewind_to_last_step_end(trainer)
        log.warning("stop signal during step %d's rollout: the step is abandoned; saving step %d", step + 1, step)
        raise SIGTERMException()

    def teardown(self, trainer, pl_module, stage):
        if self.pipeline is not None:
            self.pipeline.close()

    on_exception = teardown  # Lightning skips `teardown` hooks when fit raises (a signal stop included)

    def _filter_groups(self, trainer, pl_module, rollout: RolloutBatch, out: RewardOutput, params: SamplingConfig,
                       target: int, timings: Dict[str, float]):
        """`GroupFilter.run` on round 1; each further round draws the sampler's next ``prompts_per_step``
        prompts (this rank's slice) and generates and scores them as round 1 was."""
        dm, sampler = _datamodule_sampler(trainer, "draw", "rollout.dynamic_sampling",
                                          "draws further prompts from its sampler")
        rank, world = dp_rank_size(pl_module)

        def more(j: int):
            idx = sampler.draw(sampler.prompts_per_step)
            items = [dm.train_source[i] for i in idx[rank_slice(len(idx), rank, world)]]
            p = replace(params, seed=round_seed(params.seed, j))
            spent = {k: timings.get(k, 0.0) for k in ("time/weight_sync", "time/generate", "time/reward")}
            r = self._generate(pl_module, [x.prompt for x in items], p, timings)
            t0 = time.perf_counter()
            o = self._score(r, [x.answer for x in items], p)
            r.rewards = torch.tensor(o.scores, dtype=torch.float32, device=r.response_ids.device)
            timings["time/reward"] = time.perf_counter() - t0
            for k, v in spent.items():  # the step's time over all rounds
                timings[k] = timings.get(k, 0.0) + v
            return r, self.group_filter.values(o.scores, o.components)

        first = (rollout, self.group_filter.values(out.scores, out.components))
        kept, metrics = self.group_filter.run(first, more, target, pl_module.device)
        kept.advantages = self._advantages(kept, kept.rewards)
        return kept, metrics

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        rank, world = dp_rank_size(pl_module)
        params = replace(self.val_sampling, seed=val_seed(self.seed, batch_idx, rank))
        prompts, answers = batch["prompts"], batch["answers"]
        real = len(prompts)
        if world > 1:  # equal counts on every rank (lockstep generation); padding is not scored
            (prompts, real), (answers, _) = pad_slice(prompts, rank, world), pad_slice(answers, rank, world)
        rollout = self._generate(pl_module, prompts, params, {})
        out = self._score(rollout, answers, params)
        n = real * params.n
        scores = out.scores[:n]
        correct = out.components.get("correct", [float(s > 0) for s in out.scores])[:n]
        batch["val_stats"] = {
            "val/accuracy": sum(correct) / max(n, 1),
            "val/reward": sum(scores) / max(n, 1),
            "val/response_len": float(rollout.lengths[:n].float().mean()) if n else 0.0,
            "val/overlong_rate": float(rollout.overlong[:n].float().mean()) if n else 0.0,
            "_count": n,
        }
