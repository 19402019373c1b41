"""The rollout callback: turns each batch of prompts into a scored rollout batch before the step runs.

Owns: `RolloutCallback`. Each training step, in ``on_train_batch_start``:

    sync weights -> generate G completions per prompt -> decode -> reward -> advantages

and stores the `RolloutBatch` in ``batch["rollout"]`` (the same dict Lightning then passes to
``training_step``) with reward statistics in ``batch["rollout_metrics"]`` and timings in
``pl_module.timings``. Validation batches get ``batch["val_stats"]`` (accuracy, reward, length,
overlong rate) from completions sampled with the validation settings.
Leaves out: the engines (fspo/rollout), the reward functions (fspo/rewards), the advantage
estimators (fspo/advantages.py) and the update itself (fspo/module.py).

Seeding: step k samples with seed ``seed * 1_000_003 + k``; validation batch j always with
``seed * 1_000_003 + 999_999_937 + j``, so successive validations differ only by the policy.
"""
from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Dict, List

import lightning as L
import torch

from fspo.rollout.base import RolloutEngine, SamplingConfig
from fspo.types import RolloutBatch


class RolloutCallback(L.Callback):
    """Drives the rollout engine; see the module docstring. ``max_prompt_len`` bounds prompt tokens."""

    def __init__(self, engine: RolloutEngine, tokenizer, reward_fn, advantage_fn: Callable,
                 sampling: SamplingConfig, val_sampling: SamplingConfig, max_prompt_len: int = 1024,
                 seed: int = 0):
        self.engine = engine
        self.tokenizer = tokenizer
        self.reward_fn = reward_fn
        self.advantage_fn = advantage_fn
        self.sampling = sampling
        self.val_sampling = val_sampling
        self.max_prompt_len = max_prompt_len
        self.seed = seed
        self._ready = False

    # ------------------------------------------------------------------ lifecycle
    def setup(self, trainer, pl_module, stage):
        if not self._ready:
            workdir = Path(trainer.default_root_dir) / "engine"
            workdir.mkdir(parents=True, exist_ok=True)
            self.engine.setup(pl_module.policy, self.tokenizer, str(workdir))
            self._ready = True

    def _tokenize(self, prompts: List[str]) -> List[List[int]]:
        ids = self.tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
        longest = max((len(x) for x in ids), default=0)
        if longest > self.max_prompt_len:
            raise ValueError(
                f"a prompt has {longest} tokens but data.max_prompt_len is {self.max_prompt_len}: raise "
                f"data.max_prompt_len or filter long prompts")
        return ids

    def _generate(self, pl_module, prompts: List[str], params: SamplingConfig) -> RolloutBatch:
        t0 = time.perf_counter()
        self.engine.sync_weights(pl_module.policy)
        self.engine.wake()
        t1 = time.perf_counter()
        rollout = self.engine.generate(self._tokenize(prompts), params)
        self.engine.sleep()
        t2 = time.perf_counter()
        pl_module.timings["time/weight_sync"] = t1 - t0
        pl_module.timings["time/generate"] = t2 - t1
        return rollout.to(pl_module.device)

    def _score(self, rollout: RolloutBatch, answers: List[str], params: SamplingConfig):
        texts = self.tokenizer.batch_decode(rollout.response_ids, skip_special_tokens=True)
        refs = [answers[int(g)] for g in rollout.group_ids]
        out = self.reward_fn(texts, refs, rollout.lengths.tolist(), rollout.overlong.tolist(),
                             params.max_new_tokens)
        return out

    # ------------------------------------------------------------------ training
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        step = int(pl_module.rl_step)
        params = replace(self.sampling, seed=self.seed * 1_000_003 + step)
        rollout = self._generate(pl_module, batch["prompts"], params)
        t0 = time.perf_counter()
        out = self._score(rollout, batch["answers"], params)
        rewards = torch.tensor(out.scores, dtype=torch.float32, device=rollout.response_ids.device)
        rollout.rewards = rewards
        rollout.advantages = self.advantage_fn(rewards, rollout.group_ids).float()
        pl_module.timings["time/reward"] = time.perf_counter() - t0
        metrics: Dict[str, float] = {"reward/mean": float(rewards.mean()), "reward/errors": float(out.errors)}
        for name, vals in out.components.items():
            metrics[f"reward/{name}"] = float(sum(vals) / max(len(vals), 1))
        # fraction of prompts whose G rewards are all equal (zero advantage: no learning signal)
        g = rollout.group_ids
        n_groups = int(g.max()) + 1 if len(g) else 0
        if n_groups:
            rmax = torch.full((n_groups,), -float("inf"), device=g.device).scatter_reduce(0, g, rewards, "amax")
            rmin = torch.full((n_groups,), float("inf"), device=g.device).scatter_reduce(0, g, rewards, "amin")
            metrics["reward/zero_adv_group_frac"] = float((rmax == rmin).float().mean())
        batch["rollout"] = rollout
        batch["rollout_metrics"] = metrics

    # ------------------------------------------------------------------ validation
    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        params = replace(self.val_sampling, seed=self.seed * 1_000_003 + 999_999_937 + batch_idx)
        rollout = self._generate(pl_module, batch["prompts"], params)
        out = self._score(rollout, batch["answers"], params)
        correct = out.components.get("correct", [float(s > 0) for s in out.scores])
        n = len(out.scores)
        batch["val_stats"] = {
            "val/accuracy": sum(correct) / max(n, 1),
            "val/reward": sum(out.scores) / max(n, 1),
            "val/response_len": float(rollout.lengths.float().mean()) if n else 0.0,
            "val/overlong_rate": float(rollout.overlong.float().mean()) if n else 0.0,
            "_count": n,
        }
