"""The LightningModule: the policy, its optimizer and the PPO-style update on a rollout batch.

Per RL step (B = prompts_per_step * G sequences), for each of ``epochs`` passes the batch is shuffled into
mini-batches of ``mini_batch_size`` ``mini_batch_unit``s (microbatches.py); each is one optimizer step, its loss
accumulated over token-budget micro-batches with the mini-batch's token and sequence counts as denominators, so
micro-batching never changes the loss. Old log-probs: ``engine`` takes the engine's (the train-inference gap is
logged as ``rollout/logprob_gap``); ``recompute`` runs a no-grad pass, skipping (with one epoch) the first
mini-batch's rows, whose loss pass's detached log-probs are the old ones (ratio 1). The first mini-batch is
on-policy (S = 0: left out of the log-ratio statistics and the band's ``observe``) only when its old log-probs are
the current weights' (recomputed, or the engine's with ``policy_lag`` 0); under ``rollout.overlap`` it is stale.
"""
from __future__ import annotations

import time
from collections import Counter
from typing import Dict, Optional

import lightning as L
import torch

from fspo.models.lora import is_lora
from fspo.models.segment_attention import enable_segment_attention
from fspo.runtime.launch.distributed import (
    clip_grad_norm,
    configure_sharding,
    dp_rank_size,
    gather_group_ids,
    gather_rollout,
    max_over_ranks,
    rank_offset,
    reduce_step_stats,
    reduce_sum,
)
from fspo.seeds import step_seed
from fspo.types import RolloutBatch
from fspo.update import forward as passes
from fspo.update.grad_probe import probe_minibatch
from fspo.update.guard import DivergenceGuard, UpdateMeter
from fspo.update.metric_logging import emit_metrics
from fspo.update.microbatches import balanced_rank_rows
from fspo.update.settings import PPOConfig
from fspo.update.stats import StepStats, peak_memory_mib
from fspo.update.update_ratio import UpdateRatio


class RLModule(L.LightningModule):
    """``policy`` an HF causal LM; ``clip`` a `ClipRule`; ``aggregator`` maps (token_loss, response_mask,
    total_tokens=, total_seqs=) to an object with ``.loss``; ``diagnostics`` a per-step `FairnessMetrics`,
    ``run_diagnostics`` one over the whole run; ``ledger`` a `SequenceLedger` or None."""

    def __init__(self, policy, clip, aggregator, ppo: PPOConfig, diagnostics, run_diagnostics=None,
                 seed: int = 0, guard: Optional[DivergenceGuard] = None, correction=None, probe_every: int = 0,
                 ledger=None):
        super().__init__()
        self.policy = policy
        self.probe_every = int(probe_every)  # grad_probe.py every N steps on the last mini-batch; 0: off
        if self.probe_every < 0:
            raise ValueError(f"diagnostics.grad_probe_every must be >= 0 (0: off), got {probe_every!r}")
        self.strict_loading = not is_lora(policy)  # LoRA checkpoints hold the adapters; the base comes from the config
        # train-inference mismatch weights; None or mode none: off
        self.correction = correction if correction is not None and correction.enabled else None
        self.guard = guard  # divergence limits checked before every optimizer step (guard.py); None: off
        if ppo.packing:  # sdpa models: packed micro-batches as one unpadded row
            enable_segment_attention(policy)
        self.clip = clip
        self.aggregator = aggregator
        self.ppo = ppo
        self.diagnostics = diagnostics
        self.run_diagnostics = run_diagnostics
        self.ledger = ledger
        self.seed = seed
        self.automatic_optimization = False
        self.timings: Dict[str, float] = {}  # this step's seconds per phase: the rollout's, then the update's
        self.register_buffer("skipped_updates", torch.zeros((), dtype=torch.long))
        # RL steps completed: the logged step of a step's metrics and later validations ("after s updates")
        self.register_buffer("rl_step", torch.zeros((), dtype=torch.long))
        self._val_sums: Counter = Counter()

    def configure_optimizers(self):
        # trainable parameters only: with LoRA the adapters, so no optimizer state for the base
        trainable = [p for p in self.policy.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(trainable, lr=self.ppo.lr, betas=tuple(self.ppo.betas),
                                weight_decay=self.ppo.weight_decay)
        warm = max(0, int(self.ppo.warmup_steps))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0)
        return [opt], [sched]

    def configure_model(self):
        """Shard the policy under `trainer=fsdp`; a no-op on one device."""
        configure_sharding(self)

    def _diagnostics(self):
        return [d for d in (self.diagnostics, self.run_diagnostics) if d is not None]

    def _has_gap(self, batch: RolloutBatch) -> bool:
        """The engine reported log-probs (at temperature 1) and the trainer's are at temperature 1 too."""
        return batch.engine_log_probs is not None and float(self.ppo.logprob_temperature) == 1.0

    def training_step(self, batch, batch_idx):
        rollout: Optional[RolloutBatch] = batch.get("rollout") if isinstance(batch, dict) else None
        if rollout is None:
            raise RuntimeError("training batch has no 'rollout': add fspo.rollout.callback.RolloutCallback to the "
                               "Trainer's callbacks (experiments/run.py does this)")
        rollout.validate()
        self.timings = dict(batch.get("rollout_timings", {}))  # generation and reward
        opt = self.optimizers()
        stats = StepStats()
        moved = UpdateRatio().snapshot(self.policy.parameters()) if self.ppo.update_ratio else None
        # data parallel: each rank generated its share; after its old log-probs the batch is gathered
        rank, world = dp_rank_size(self)
        local = rollout
        global_size = int(reduce_sum([rollout.batch_size], self.device)[0])
        g = torch.Generator().manual_seed(step_seed(self.seed, int(self.rl_step)))
        groups = None  # mini_batch_unit=prompts: the global batch's group ids
        if self.ppo.mini_batch_unit == "prompts" and rollout.group_ids is not None:
            groups = gather_group_ids(rollout.group_ids)
        plan = self.ppo.minibatch_plan(global_size, g, groups)
        t0 = time.perf_counter()
        if rollout.old_log_probs is None and self.ppo.old_log_probs == "engine":
            if rollout.engine_log_probs is None:
                raise ValueError(
                    "ppo.old_log_probs=engine but the rollout engine reported no log-probs (HFEngine reports them "
                    "when rollout.engine.compact=true, VLLMEngine always): set ppo.old_log_probs=recompute")
            rollout.old_log_probs = rollout.engine_log_probs.float() * rollout.response_mask
        supplied = rollout.old_log_probs is not None
        if not supplied:
            # one epoch: the first mini-batch's loss pass gives its old log-probs (a correction needs all rows')
            offset = rank_offset(rollout.batch_size, rank, world, self.device)
            first = plan[0] - offset if self.ppo.epochs == 1 and self.correction is None else plan[0][:0]
            first = first[(first >= 0) & (first < rollout.batch_size)]
            rollout.old_log_probs = passes.old_log_probs(self, rollout, usage=stats.usage_old, skip=first)
            if self._has_gap(rollout):  # the skipped rows' gap is taken in their loss pass (_update)
                computed = rollout.response_mask.clone()
                computed[first.to(computed.device)] = 0
                stats.add_gap(rollout.engine_log_probs, rollout.old_log_probs, computed)
        if self.correction is not None:  # the step's mismatch law and diagnostics, from this rank's rows
            self.correction.fit(rollout)
        rollout = gather_rollout(rollout)
        self.timings["time/old_log_probs"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        lag = int(batch.get("policy_lag", 0))
        probed: Dict[str, float] = {}
        # each rank's rows of a mini-batch are balanced by tokens (one host read per step, with several ranks)
        tokens = (rollout.prompt_mask.sum(-1) + rollout.lengths).cpu() if world > 1 else None
        for updates, mb_idx in enumerate(plan):
            mb = rollout.select(mb_idx.to(rollout.response_ids.device))
            if self.probe_every and len(plan) > 1 and updates == len(plan) - 1 and self.rl_step % self.probe_every == 0:
                probed = probe_minibatch(self, mb)  # off-policy by now: the earlier mini-batches moved the policy
            # the gap of rows the old-log-prob pass did not compute is taken in the first loss pass
            self._update(mb, opt, stats, on_policy=(updates == 0 and (not supplied or lag == 0)),
                         old_from_loss=(updates == 0 and not supplied),
                         gap=(updates == 0 and (supplied or self.ppo.epochs == 1)),
                         rows=None if tokens is None else balanced_rank_rows(tokens[mb_idx], rank, world),
                         update=updates)
        self.lr_schedulers().step()
        if moved is not None:
            stats.update_ratio = moved.compute(self.policy.parameters(), self.device)
        self.timings["time/train"] = time.perf_counter() - t0
        extra = {**batch.get("rollout_metrics", {}), **probed}
        self._log_step(local, stats, extra)
        self.rl_step += 1

    def _update(self, mb: RolloutBatch, opt, stats: "StepStats", on_policy: bool, old_from_loss: bool = False,
                rows=None, gap: bool = False, update: int = 0) -> None:
        """One optimizer step on ``mb`` (this rank runs its ``rows``; the denominators are ``mb``'s). With
        ``old_from_loss`` the loss pass's detached log-probs are the old ones; with ``gap`` they are compared with
        the engine's. Loss and gradient finiteness is read once per update, over ranks; a non-finite one skips the
        step (or raises: ``ppo.nonfinite``), the statistics keeping the micro-batches before it."""
        total_tokens = mb.lengths.sum().clamp(min=1)
        total_seqs = mb.batch_size
        norm_len = mb.response_mask.shape[-1]  # seq-mean-token-sum-norm: the mini-batch's width, not a micro-batch's
        dummy = passes.dummy_micro_batch(mb)  # zero-weight: ranks with fewer micro-batches run it (FSDP lockstep)
        if rows is not None:
            mb = mb.select(rows.to(mb.response_ids.device))
        opt.zero_grad()
        observed = []
        meter = UpdateMeter()  # this update's loss and KL for the divergence guard
        groups, width = passes.micro_batches(self, mb)
        finite, records = [], []  # per micro-batch: loss finite (device flags); what it records, once they are read
        for pos, idx in enumerate(groups):
            micro = dummy if idx is None else mb.select(idx).trim()
            logp, ent = passes.log_probs(self, micro, with_entropy=self.ppo.log_entropy, pack_width=width,
                                       usage=None if idx is None else stats.usage)
            old = logp.detach() if old_from_loss else micro.old_log_probs  # no update yet: the old policy
            t_l = time.perf_counter()
            res = self.clip(logp, old, micro.advantages, micro.response_mask)
            fix = self.correction is not None and idx is not None  # the dummy's loss is multiplied by 0 anyway
            tok_loss = res.token_loss * self.correction.weights(micro, logp.detach()) if fix else res.token_loss
            agg = self.aggregator(tok_loss, micro.response_mask, total_tokens=total_tokens,
                                  total_seqs=total_seqs, norm_len=norm_len)
            stats.loss_time += time.perf_counter() - t_l
            loss = agg.loss if idx is not None else agg.loss * 0.0
            finite.append(torch.isfinite(loss.detach()))  # no host read here: checked once, before the step
            self.manual_backward(loss)  # a non-finite loss makes the gradient non-finite too: never stepped
            if idx is None:
                continue
            records.append((pos, micro, agg.loss.detach(), logp.detach(), old, ent, res))
            meter.add(res.token_loss, logp, old, micro.response_mask)
            observed.append((res.seq_log_ratio, micro.lengths, (logp.detach() - old), micro.response_mask))
        grad_norm = clip_grad_norm(self.policy.parameters(), self.ppo.max_grad_norm)
        # one host read (max over ranks): which micro-batch's loss was non-finite, the gradient norm's finiteness
        z = torch.zeros((), device=grad_norm.device)
        flags = max_over_ranks(torch.stack([(~f).float() for f in finite] + [(~torch.isfinite(grad_norm)).float(),
                                           torch.where(torch.isfinite(grad_norm), grad_norm.float(), z)]))
        first_bad = next((i for i, f in enumerate(flags[:-2]) if f), len(groups))
        stats.nonfinite = first_bad < len(groups)
        for pos, micro, *rec in records:  # as if the loop had stopped at the first non-finite loss
            if pos <= first_bad:
                self._record(micro, *rec, stats, on_policy, gap, update, loss_ok=pos < first_bad)
        skip = bool(stats.nonfinite or flags[-2])
        if skip and self.ppo.nonfinite == "raise":
            raise FloatingPointError(
                "non-finite loss or gradient in the policy update; set ppo.nonfinite=skip to skip such "
                "updates instead (the last checkpoint is intact)")
        if not skip and self.guard is not None:  # collective: every rank checks every update, same verdict
            update = len(stats.grad_norms) + stats.skipped + 1  # this step's updates so far, stepped or skipped
            verdict = self.guard.check(grad_norm, meter, self.device, lr=float(opt.param_groups[0]["lr"]),
                                       where=f"RL step {int(self.rl_step)}, update {update}")
            stats.guard_trips += verdict != "step"
            skip = verdict == "skip"
        if skip:  # exactly no update: gradients dropped, no optimizer step
            opt.zero_grad()
            self.skipped_updates += 1
            stats.skipped += 1
            return
        opt.step()
        stats.grad_norms.append(flags[-1])
        # on-policy mini-batches have S == 0 exactly: no information on sigma; with several ranks every
        # rank calls observe (it all-reduces), even one whose share was empty
        if not on_policy and (observed or dp_rank_size(self)[1] > 1):
            # once per optimizer step, on the whole mini-batch (micro-batches joined; tokens flattened)
            z = torch.zeros(0, device=self.device)
            seq = torch.cat([z] + [o[0] for o in observed])
            lengths = torch.cat([z.long()] + [o[1] for o in observed])
            tok = torch.cat([z] + [o[2][o[3].bool()] for o in observed])
            self.clip.observe(seq, lengths, tok, torch.ones_like(tok))

    def _record(self, micro, loss, logp, old, ent, res, stats, on_policy, gap, update, loss_ok=True) -> None:
        """A micro-batch's statistics, diagnostics and ledger records (``loss_ok`` False: only the gap)."""
        if gap and self._has_gap(micro):  # no update yet: the policy the engine sampled
            stats.add_gap(micro.engine_log_probs, logp, micro.response_mask)
        if not loss_ok:
            return
        t_m = time.perf_counter()
        stats.add_micro(loss, logp, old, ent, micro.response_mask)
        # on-policy mini-batches have S == 0 exactly: counted for clipping, not for log-ratio stats
        for d in self._diagnostics():
            d.update_clip(res, micro.lengths, micro.response_mask, micro.advantages, log_ratio=not on_policy,
                          token_log_ratio=None if on_policy else (logp - old))
        if self.ledger is not None and not on_policy:  # one record per measured sequence (the length law)
            self.ledger.update(int(self.rl_step), update, micro.group_ids, micro.lengths, logp - old,
                               micro.response_mask, micro.advantages, res.in_band)
        stats.metrics_time += time.perf_counter() - t_m

    def _log_step(self, rollout: RolloutBatch, stats: "StepStats", extra: Dict[str, float]) -> None:
        t_m = time.perf_counter()
        for d in self._diagnostics():
            d.update_rollout(rollout.lengths, rollout.overlong)
        metrics = dict(self.diagnostics.compute())
        self.diagnostics.reset()
        metrics.update(self.clip.extra_metrics())
        if self.correction is not None:
            metrics.update(self.correction.compute_metrics())
        if dp_rank_size(self)[1] > 1:
            reduce_step_stats(stats, self.device)  # token and loss sums over ranks
        metrics.update(stats.compute())
        metrics.update(extra)
        metrics["train/skipped_updates_total"] = float(self.skipped_updates)
        if int(self.ppo.warmup_steps) > 0:  # else constant: the param ppo/lr, not a metric
            metrics["train/lr"] = float(self.optimizers().param_groups[0]["lr"])
        self.timings["time/metrics"] = stats.metrics_time + time.perf_counter() - t_m
        metrics.update(self.timings)
        tokens = reduce_sum([rollout.lengths.sum()], self.device)[0]
        step_time = sum(v for k, v in self.timings.items() if k.startswith("time/"))
        metrics["perf/step_time_s"] = step_time
        metrics["perf/peak_memory_mib"] = peak_memory_mib(self.device)
        metrics["perf/loss_metrics_share"] = (stats.loss_time + self.timings["time/metrics"]) / max(step_time, 1e-9)
        metrics["perf/response_tokens_per_s"] = tokens / max(step_time, 1e-9)
        prog_bar = {"reward/mean", "clip/seq_frac", "fairness/lre", "rollout/response_len_mean"}
        emit_metrics(self, metrics, int(self.rl_step), prog_bar)

    def validation_step(self, batch, batch_idx):
        stats = batch.get("val_stats") if isinstance(batch, dict) else None
        if stats is None:
            raise RuntimeError("validation batch has no 'val_stats': add fspo.rollout.callback.RolloutCallback")
        n = stats["_count"]  # the other entries are means over n prompts: summed as v * n
        self._val_sums.update({k: n if k == "_count" else v * n for k, v in stats.items()})

    def on_validation_epoch_end(self):
        sums, self._val_sums = self._val_sums, Counter()
        n = sums.pop("_count", 0)
        if n or self.trainer.world_size > 1:  # a rank may hold only padding prompts (n = 0): it still reduces
            metrics = {k: v / max(n, 1) for k, v in sums.items()}
            if self.trainer.world_size > 1:  # exact mean over ranks: all-reduce the sums
                t = torch.tensor([n] + [sums[k] for k in sorted(sums)], dtype=torch.float64, device=self.device)
                t = self.trainer.strategy.reduce(t, reduce_op="sum")
                metrics = {k: float(t[i + 1] / t[0].clamp(min=1)) for i, k in enumerate(sorted(sums))}
            emit_metrics(self, metrics, int(self.rl_step), {"val/accuracy"}, on_step=False)
