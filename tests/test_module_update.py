"""RLModule's update: micro-batching never changes it; a non-finite loss is skipped or raised.

How the update is driven: through a real, minimal `lightning.Trainer` (one training batch, no
logger, no checkpoints) with a callback that puts a hand-built `RolloutBatch` into the batch dict
in ``on_train_batch_start`` — the same hand-off `fspo.rollout.callback.RolloutCallback` uses — and a
callback that copies every parameter's gradient in ``on_before_optimizer_step`` (called for
manual optimization too). This uses only Lightning's public hooks and the module's documented
batch contract, so it survives refactors of the module's private functions (calling `_update` with a
dummy optimizer would need `manual_backward` to work outside a Trainer, which it does not).

The micro-batching test swaps AdamW for plain SGD (a subclass overriding only
`configure_optimizers`): Adam's first step is ~lr * sign(g), so two gradients that agree to 1e-7
but straddle |g| ~ 1e-9 give parameters that differ by ~lr; with SGD the parameter change is
linear in the gradient and "same gradients -> same parameters" is a meaningful check.
"""
from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
from hydra.utils import instantiate
from torch.utils.data import DataLoader

from conftest import clip_config
from fspo.diagnostics import FairnessMetrics, LengthBins
from fspo.losses import Aggregator
from fspo.models.tiny import build_tiny_model
from fspo.types import RolloutBatch
from fspo.update.logprobs import response_log_probs
from fspo.update.microbatches import token_budget_micro_batches
from fspo.update.module import RLModule
from fspo.update.packing import packed_micro_batches
from fspo.update.settings import PPOConfig

B = 8


def make_rollout(seed: int = 0) -> RolloutBatch:
    """8 sequences with prompts of 3..9 and responses of 1..12 tokens; old log-probs are the
    model's own plus N(0, 0.05^2) per token, so log-ratios are non-zero and FSPO's band
    (0.03 sqrt(L)) binds on some sequences."""
    g = torch.Generator().manual_seed(seed)
    p_len = torch.randint(3, 10, (B,), generator=g)
    r_len = torch.tensor([1, 12, 5, 7, 3, 12, 9, 2])
    P, T = int(p_len.max()), int(r_len.max())
    prompt_ids = torch.zeros(B, P, dtype=torch.long)
    prompt_mask = torch.zeros(B, P, dtype=torch.long)
    response_ids = torch.zeros(B, T, dtype=torch.long)
    response_mask = torch.zeros(B, T, dtype=torch.long)
    for i in range(B):
        prompt_ids[i, P - p_len[i]:] = torch.randint(4, 100, (int(p_len[i]),), generator=g)
        prompt_mask[i, P - p_len[i]:] = 1
        response_ids[i, :r_len[i]] = torch.randint(4, 100, (int(r_len[i]),), generator=g)
        response_mask[i, :r_len[i]] = 1
    batch = RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                         response_mask=response_mask, group_ids=torch.arange(B) // 4,
                         advantages=torch.tensor([1.0, -1.0, 0.5, -0.5, 1.5, -1.2, 0.8, -0.3]),
                         rewards=torch.zeros(B), overlong=torch.zeros(B, dtype=torch.bool))
    with torch.no_grad():
        lp, _ = response_log_probs(build_tiny_model(seed=0), batch)
    noise = 0.05 * torch.randn(B, T, generator=g)
    batch.old_log_probs = ((lp + noise) * response_mask).float()
    return batch.validate()


class InjectRollout(L.Callback):
    def __init__(self, rollout: RolloutBatch, policy_lag: int = 0):
        self.rollout, self.policy_lag = rollout, policy_lag

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        batch["rollout"] = copy.deepcopy(self.rollout)
        batch["policy_lag"] = self.policy_lag  # as RolloutCallback: rollout.overlap's steps of lag, else 0


class RecordGrads(L.Callback):
    def __init__(self):
        self.grads = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads.append({n: p.grad.detach().clone() for n, p in pl_module.policy.named_parameters()
                           if p.grad is not None})


class SGDModule(RLModule):
    """RLModule with plain SGD (see the module docstring); everything else unchanged."""

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.policy.parameters(), lr=self.ppo.lr)
        return [opt], [torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)]


def run_update(rollout: RolloutBatch, clip_name: str = "fspo", agg_mode: str = "token-mean", sgd: bool = False,
               policy_lag: int = 0, **ppo):
    """One RL step (``B / mini_batch_size`` optimizer updates) on ``rollout``; returns
    (module, recorded gradients, logged metrics)."""
    settings = dict(mini_batch_size=4, mini_batch_unit="sequences", micro_batch_max_tokens=8192,
                    lr=0.1 if sgd else 1e-3, max_grad_norm=1.0)
    settings.update(ppo)
    bins = LengthBins(width=4, max_len=12)
    clip = instantiate(clip_config(clip_name))
    module = (SGDModule if sgd else RLModule)(policy=build_tiny_model(seed=0), clip=clip,
                                              aggregator=Aggregator(agg_mode), ppo=PPOConfig(**settings),
                                              diagnostics=FairnessMetrics(bins), run_diagnostics=None, seed=0)
    rec = RecordGrads()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=0, callbacks=[InjectRollout(rollout, policy_lag), rec])
    data = DataLoader([{"prompts": ["unused"]}], batch_size=None)  # one RL step
    trainer.fit(module, train_dataloaders=data)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    return module, rec.grads, metrics


@pytest.mark.parametrize("packing", [True, False])
@pytest.mark.parametrize("clip_name,agg_mode", [("fspo", "token-mean"), ("grpo", "token-mean"),
                                                ("gspo", "seq-mean-token-mean"), ("rloo", "seq-mean-token-sum"),
                                                ("fspo", "seq-mean-token-sum-norm"), ("rloo", "token-sum")])
def test_micro_batching_does_not_change_the_update(clip_name, agg_mode, packing):
    rollout = make_rollout()
    small_budget = 24
    # the small budget really splits each 4-sequence mini-batch (rows * longest <= 24 tokens)
    totals = rollout.prompt_mask.sum(-1) + rollout.lengths
    assert len(token_budget_micro_batches(totals, small_budget)) >= 5
    assert len(packed_micro_batches(totals, small_budget)) >= 5

    one, g_one, m_one = run_update(rollout, clip_name, agg_mode, sgd=True, micro_batch_max_tokens=100_000,
                                   packing=packing)
    many, g_many, m_many = run_update(rollout, clip_name, agg_mode, sgd=True, micro_batch_max_tokens=small_budget,
                                      packing=packing)

    assert len(g_one) == len(g_many) == 2  # 8 sequences / mini-batches of 4
    for step, (a, b) in enumerate(zip(g_one, g_many)):
        assert a.keys() == b.keys() and a
        assert sum(float(v.abs().sum()) for v in a.values()) > 0
        for name in a:
            torch.testing.assert_close(b[name], a[name], atol=1e-6, rtol=0, msg=f"update {step}: grad {name}")
    init = dict(build_tiny_model(seed=0).named_parameters())
    moved = 0.0
    for (name, p1), (_, p2) in zip(one.policy.named_parameters(), many.policy.named_parameters()):
        torch.testing.assert_close(p2, p1, atol=1e-6, rtol=0, msg=f"parameter {name}")
        moved = max(moved, float((p1 - init[name]).abs().max()))
    assert moved > 1e-3  # the two updates did move the parameters
    for key in ("train/loss", "train/kl", "clip/seq_frac", "clip/tok_frac"):
        assert m_many[key] == pytest.approx(m_one[key], abs=1e-6, rel=1e-5), key
    assert int(one.skipped_updates) == int(many.skipped_updates) == 0
    if clip_name == "fspo":  # the band binds on some sequences: the clipped branch is exercised too
        assert 0.0 < m_one["clip/seq_frac"] < 1.0


def test_update_changes_parameters():
    """Control for the skip test: the same batch without a NaN does move the parameters."""
    before = {n: p.detach().clone() for n, p in build_tiny_model(seed=0).named_parameters()}
    module, grads, _ = run_update(make_rollout(), mini_batch_size=B)
    assert len(grads) == 1
    assert any(not torch.equal(before[n], p) for n, p in module.policy.named_parameters())


def _nan_rollout() -> RolloutBatch:
    rollout = make_rollout()
    rollout.old_log_probs[1, 3] = float("nan")  # a response token (row 1 has 12)
    return rollout


def test_nonfinite_update_is_skipped():
    before = {n: p.detach().clone() for n, p in build_tiny_model(seed=0).named_parameters()}
    module, grads, metrics = run_update(_nan_rollout(), mini_batch_size=B, nonfinite="skip")
    assert grads == []  # no optimizer step was taken
    for n, p in module.policy.named_parameters():
        assert torch.equal(before[n], p), n
    assert int(module.skipped_updates) == 1
    assert metrics["train/skipped_updates"] == 1.0 and metrics["train/skipped_updates_total"] == 1.0


def test_nonfinite_update_skips_only_its_mini_batch():
    rollout = _nan_rollout()
    module, grads, metrics = run_update(rollout, mini_batch_size=4, nonfinite="skip")
    assert len(grads) == 1 and int(module.skipped_updates) == 1  # the other mini-batch still updates
    assert metrics["train/updates"] == 1.0


def test_nonfinite_update_raises_when_asked():
    with pytest.raises(FloatingPointError, match="nonfinite"):
        run_update(_nan_rollout(), mini_batch_size=B, nonfinite="raise")


def _engine_rollout(offset: float) -> RolloutBatch:
    """make_rollout() as a fresh rollout (no old log-probs) whose engine log-probs are the policy's
    own shifted by +-``offset`` per token (alternating sign), 0 on padding."""
    rollout = make_rollout()
    rollout.old_log_probs = None
    with torch.no_grad():
        lp, _ = response_log_probs(build_tiny_model(seed=0), rollout)
    sign = torch.where(torch.arange(lp.shape[1]) % 2 == 0, 1.0, -1.0)
    rollout.engine_log_probs = ((lp + offset * sign) * rollout.response_mask).float()
    return rollout


@pytest.mark.parametrize("mini_batch_size", [4, B])  # old log-probs pass | single update (loss pass)
def test_train_inference_gap_is_logged(mini_batch_size):
    """rollout/logprob_gap = mean_t |logp_engine - logp_trainer| over response tokens: with the
    engine's log-probs off by exactly +-0.01 on every token it reads 0.01."""
    _, _, metrics = run_update(_engine_rollout(0.01), mini_batch_size=mini_batch_size)
    assert metrics["rollout/logprob_gap"] == pytest.approx(0.01, abs=1e-6)


def test_train_inference_gap_needs_temperature_one():
    """Engine log-probs are at temperature 1 (vLLM's raw log-probs): not compared with tempered ones."""
    _, _, metrics = run_update(_engine_rollout(0.01), mini_batch_size=4, logprob_temperature=0.7)
    assert "rollout/logprob_gap" not in metrics
    _, _, metrics = run_update(make_rollout(), mini_batch_size=4)  # no engine log-probs: no gap
    assert "rollout/logprob_gap" not in metrics


@pytest.mark.parametrize("epochs", [1, 2])
def test_engine_old_log_probs_are_the_engines(epochs):
    """ppo.old_log_probs=engine: the engine's log-probs (here the policy's own, off by +-0.01 per
    token) are the old ones: the update equals the one with those numbers given up front, differs
    from recomputing them, runs no old-log-prob forward, and takes the gap once per row of the
    first mini-batch (in its loss pass, before any update)."""
    given = _engine_rollout(0.01)
    given.old_log_probs = given.engine_log_probs.clone()
    _, g_eng, m_eng = run_update(_engine_rollout(0.01), sgd=True, epochs=epochs, old_log_probs="engine")
    _, g_giv, _ = run_update(given, sgd=True, epochs=epochs)
    _, g_rec, m_rec = run_update(_engine_rollout(0.01), sgd=True, epochs=epochs)
    assert len(g_eng) == len(g_giv) == len(g_rec) == 2 * epochs
    for a, b in zip(g_giv, g_eng):
        for name in a:
            torch.testing.assert_close(b[name], a[name], atol=0, rtol=0, msg=name)
    assert max(float((a[n] - b[n]).abs().max()) for a, b in zip(g_rec, g_eng) for n in a) > 1e-5
    assert m_eng["perf/old_log_probs_tokens"] == 0.0 < m_rec["perf/old_log_probs_tokens"]
    assert m_eng["rollout/logprob_gap"] == pytest.approx(0.01, abs=1e-6)


def test_engine_old_log_probs_need_engine_log_probs_and_temperature_one():
    with pytest.raises(ValueError, match="reported no log-probs.*recompute"):
        run_update(_fresh_rollout(), old_log_probs="engine")
    with pytest.raises(ValueError, match="temperature 1.*0.7.*ppo.old_log_probs=recompute"):
        PPOConfig(old_log_probs="engine", logprob_temperature=0.7)
    with pytest.raises(ValueError, match="'recompute' or 'engine'"):
        PPOConfig(old_log_probs="rollout")


def test_packing_does_not_change_the_update():
    """Packed rows (block-diagonal attention) and padded micro-batches give the same gradients and
    metrics; the packed pass computes fewer padded slots (perf/padding_waste)."""
    rollout = make_rollout()
    _, g_pack, m_pack = run_update(rollout, sgd=True, packing=True, micro_batch_max_tokens=40)
    _, g_pad, m_pad = run_update(rollout, sgd=True, packing=False, micro_batch_max_tokens=40)
    assert len(g_pack) == len(g_pad) == 2
    for a, b in zip(g_pad, g_pack):
        for name in a:
            torch.testing.assert_close(b[name], a[name], atol=1e-6, rtol=1e-4, msg=name)
    for key in ("train/loss", "train/kl", "clip/seq_frac"):
        assert m_pack[key] == pytest.approx(m_pad[key], abs=1e-6, rel=1e-5), key
    assert m_pack["perf/train_tokens"] == m_pad["perf/train_tokens"] > 0
    assert m_pack["perf/old_log_probs_tokens"] == m_pad["perf/old_log_probs_tokens"] == 0  # given old log-probs
    assert 0.0 <= m_pack["perf/padding_waste"] < m_pad["perf/padding_waste"]
    assert 0.0 < m_pack["perf/loss_metrics_share"] < 1.0


def _fresh_rollout() -> RolloutBatch:
    rollout = make_rollout()
    rollout.old_log_probs = None  # as from the rollout callback: the module computes them
    return rollout


def _first_minibatch(mini_batch_size: int) -> torch.Tensor:
    """The rows of step 0's first mini-batch (seed 0): the module's generator, drawn the same way."""
    return torch.randperm(B, generator=torch.Generator().manual_seed(0)).split(mini_batch_size)[0]


def test_first_minibatch_old_log_probs_come_from_its_loss_pass():
    """With one epoch, the old-log-prob pass leaves out the first mini-batch (its loss pass's detached
    log-probs are the old ones: the policy has not changed yet). The update equals the one with every
    old log-prob given up front, and the pass counts only the other rows' tokens."""
    rollout = _fresh_rollout()
    given = make_rollout()
    with torch.no_grad():
        lp, _ = response_log_probs(build_tiny_model(seed=0), given)
    given.old_log_probs = (lp * given.response_mask).float()  # exact pi_old for every row
    _, g_fresh, m_fresh = run_update(rollout, sgd=True, mini_batch_size=4)
    _, g_given, m_given = run_update(given, sgd=True, mini_batch_size=4)
    assert len(g_fresh) == len(g_given) == 2
    for a, b in zip(g_given, g_fresh):
        for name in a:
            torch.testing.assert_close(b[name], a[name], atol=1e-6, rtol=1e-4, msg=name)
    totals = rollout.prompt_mask.sum(-1) + rollout.lengths
    first = _first_minibatch(4)
    rest = torch.ones(B, dtype=torch.bool)
    rest[first] = False
    assert m_fresh["perf/old_log_probs_tokens"] == float(totals[rest].sum()) < float(totals.sum())
    assert m_fresh["train/loss"] == pytest.approx(m_given["train/loss"], abs=1e-6)


@pytest.mark.parametrize("mini_batch_size,epochs,rows", [(B, 1, "none"), (4, 2, "all")])
def test_old_log_prob_pass_size(mini_batch_size, epochs, rows):
    """One update per step: no old-log-prob forward at all. Two epochs: the first mini-batch's rows
    recur after an update, so every row's old log-probs are computed up front."""
    rollout = _fresh_rollout()
    _, grads, m = run_update(rollout, mini_batch_size=mini_batch_size, epochs=epochs)
    assert len(grads) == epochs * (B // mini_batch_size)
    totals = rollout.prompt_mask.sum(-1) + rollout.lengths
    assert m["perf/old_log_probs_tokens"] == (0.0 if rows == "none" else float(totals.sum()))


def test_engine_old_log_probs_first_minibatch_is_measured():
    """The stale first batch. Under ``rollout.overlap`` the batch was sampled by the
    engine's weights ``policy_lag`` steps behind and its old log-probs are the engine's: the first
    mini-batch's ratio is against that behaviour policy, so it is NOT on-policy: with one update per
    step its band, LRE and log-ratio statistics are measured and fspo_ema's sigma-hat moves.

    Hand computation: the engine's log-probs are the policy's own + 0.01 * (+1, -1, +1, ...) per token,
    so S_i = -0.01 * (L_i mod 2): lengths (1, 12, 5, 7, 3, 12, 9, 2) give S / sqrt(L) =
    (-0.01, 0, -0.01/sqrt5, -0.01/sqrt7, -0.01/sqrt3, 0, -0.01/3, 0); sigma_1 = 0.9 * 0.03 + 0.1 * stdev."""
    import statistics

    z = [-0.01, 0.0, -0.01 / 5 ** 0.5, -0.01 / 7 ** 0.5, -0.01 / 3 ** 0.5, 0.0, -0.01 / 3, 0.0]
    expected = 0.9 * 0.03 + 0.1 * statistics.stdev(z)  # 0.02728...
    module, _, metrics = run_update(_engine_rollout(0.01), clip_name="fspo_ema", mini_batch_size=B,
                                    old_log_probs="engine", policy_lag=1)
    assert float(module.clip.sigma_hat) == pytest.approx(expected, abs=1e-7)
    assert metrics["clip/sigma_hat"] == pytest.approx(expected, abs=1e-7)
    assert "fairness/lre" in metrics and metrics["logratio/n"] == B
    # on-policy first mini-batches (S = 0 up to the engine's float gap) are still left out: the engine's
    # log-probs with no lag (a synchronous run), and recomputed ones; sigma-hat stays at sigma_0
    for rollout, ppo in ((_engine_rollout(0.01), dict(old_log_probs="engine")), (_fresh_rollout(), {})):
        module, _, metrics = run_update(rollout, clip_name="fspo_ema", mini_batch_size=B, **ppo)
        assert float(module.clip.sigma_hat) == pytest.approx(0.03) and "fairness/lre" not in metrics
