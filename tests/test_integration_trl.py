"""fspo.integrations.trl against TRL itself (the ``trl`` extra; .ci/run installs it; skips without it).

- benchmarks/trl_fspo_example.py (docs/integrations.md's CPU example): FSPOTrainer trains 2 steps
  with the tiny Qwen3 and a toy reward and logs ``clip_ratio/by_length/<bin>``;
- on a batch captured from that run, FSPOTrainer's loss and gradient equal our registry's ``fspo``
  with TRL's normaliser restated by hand (off-policy, clips binding), with and without TRL's vLLM
  importance-sampling ratio ([B, T] and [B, 1]);
- on-policy (every ratio 1, nothing clipped) FSPO's loss and gradient equal GRPOTrainer's own
  ``_compute_loss`` for each supported loss_type: the aggregation map reproduces TRL's normalisation;
- ``clip_rule``: VESPO through FSPOTrainer equals TRL's own ``loss_type="vespo"``; FSPO's EMA band observes
  the training batches;
- FSPOConfig's paper defaults and its one-line refusals.
(The tests that use the trained example run come before the ones that build a failing trainer: that resets
accelerate's state.)
"""
from __future__ import annotations

import copy

import pytest
import torch

from conftest import REPO

pytest.importorskip("trl", reason="TRL is not installed: pip install 'fspo[trl]' (.ci/run does)")
import trl_fspo_example as example  # noqa: E402  (benchmarks/ is on pytest's path: pyproject's pythonpath)
from trl import GRPOTrainer  # noqa: E402

from fspo.clipping.registry import get_policy_loss_fn  # noqa: E402
from fspo.integrations.trl import LOSS_TYPES, FSPOConfig  # noqa: E402


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The docs' CPU example (2 optimizer steps), with the inputs of each loss call recorded."""
    from fspo.integrations.trl import FSPOTrainer

    captured = []
    original = FSPOTrainer._compute_loss

    def recording(self, model, inputs):
        captured.append(copy.deepcopy({k: v for k, v in inputs.items()}))
        return original(self, model, inputs)

    FSPOTrainer._compute_loss = recording
    try:
        # docs/integrations.md's command (its defaults: 2 steps), with the output folder in the test's tmp
        assert "python benchmarks/trl_fspo_example.py\n" in (REPO / "docs" / "integrations.md").read_text()
        trainer = example.main(["--out", str(tmp_path_factory.mktemp("trl"))])
    finally:
        FSPOTrainer._compute_loss = original
    return trainer, captured


def model_grads(trainer, loss):
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    return torch.autograd.grad(loss, params, allow_unused=True)


def assert_same_grads(ga, gb):
    for a, b in zip(ga, gb):
        if a is None or b is None:
            assert a is None and b is None
            continue
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)


def logps_of(trainer, inputs):
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    att = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    return trainer._get_per_token_logps_and_entropies(trainer.model, ids, att, inputs["completion_ids"].size(1))[0]


@pytest.mark.slow
def test_two_steps_log_per_length_clip_fractions(run):
    trainer, captured = run
    assert trainer.state.global_step == 2 and len(captured) == 2
    rows = [r for r in trainer.state.log_history if "clip_ratio/region_mean" in r]
    assert len(rows) == 2
    for r in rows:
        by_len = {k: v for k, v in r.items() if k.startswith("clip_ratio/by_length/")}
        n_seq = {k.rsplit("/", 1)[1]: v for k, v in r.items() if k.startswith("clip_ratio/n_seq/by_length/")}
        assert by_len and all(0.0 <= v <= 1.0 for v in by_len.values())
        assert sum(n_seq.values()) == 8  # 4 prompts x G 4 per generation, 2 updates: 8 sequences per log
        assert {k.rsplit("/", 1)[1] for k in by_len} == set(n_seq)
    assert captured[1].get("old_per_token_logps") is not None  # the second update is off-policy


@pytest.mark.slow
@pytest.mark.parametrize("weights", [None, "token", "sequence"])
def test_loss_and_grad_equal_registry(run, weights):
    trainer, captured = run
    inputs = copy.deepcopy(captured[1])
    mask = inputs["completion_mask"]
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # an old policy far enough away that FSPO's band binds on some sequences
        base = logps_of(trainer, inputs)
    shift = torch.randn(mask.size(0), 1, generator=g) * 0.15
    inputs["old_per_token_logps"] = base + shift
    trainer.model.train()
    trainer.use_vllm = weights is not None
    if weights is not None:
        shape = mask.shape if weights == "token" else (mask.size(0), 1)
        inputs["importance_sampling_ratio"] = 0.5 + torch.rand(shape, generator=g)
    try:
        loss = trainer._compute_loss(trainer.model, inputs)
    finally:
        trainer.use_vllm = False
    # TRL's dapo normaliser, by hand: tokens of the generation batch / processes x grad-accum / steps_per_generation
    n_items = inputs["num_items_in_batch"].float()
    assert trainer.args.steps_per_generation == 2 and trainer.current_gradient_accumulation_steps == 1
    cfg = {"global_batch_info": {"batch_num_tokens": n_items / 1 * 1 / 2}}
    logps = logps_of(trainer, inputs)
    ref, metrics = get_policy_loss_fn("fspo")(inputs["old_per_token_logps"], logps, inputs["advantages"], mask,
                                             "token-mean", cfg,
                                             rollout_is_weights=inputs.get("importance_sampling_ratio"))
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-8)
    assert_same_grads(model_grads(trainer, loss), model_grads(trainer, ref))
    assert 0.0 < metrics["actor/pg_clipfrac"] < 1.0  # some sequences clipped, some not
    if weights is not None:  # the IS ratio changes the loss
        plain, _ = get_policy_loss_fn("fspo")(inputs["old_per_token_logps"], logps, inputs["advantages"], mask,
                                             "token-mean", cfg)
        assert (plain - ref).abs() > 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_on_policy_equals_grpo_trainer(run, loss_type):
    trainer, captured = run
    inputs = copy.deepcopy(captured[0])
    inputs.pop("old_per_token_logps")  # on-policy: both then take logps.detach()
    trainer.model.train()
    saved = trainer.loss_type
    trainer.loss_type = loss_type
    try:
        ours = trainer._compute_loss(trainer.model, inputs)
        g_ours = model_grads(trainer, ours)
        theirs = GRPOTrainer._compute_loss(trainer, trainer.model, inputs)
        g_theirs = model_grads(trainer, theirs)
    finally:
        trainer.loss_type = saved
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-8)
    assert_same_grads(g_ours, g_theirs)


@pytest.mark.slow
def test_clip_rule_vespo_equals_trls_own_vespo(run):
    """FSPOConfig.clip_rule swaps the rule: VESPO (value="verl") under loss_type dapo gives TRL 1.16's own
    loss_type="vespo" loss and gradient on an off-policy batch (both normalise by the batch's tokens)."""
    from fspo.clipping.vespo import VESPOClip

    trainer, captured = run
    inputs = copy.deepcopy(captured[1])
    mask = inputs["completion_mask"]
    with torch.no_grad():
        base = logps_of(trainer, inputs)
    inputs["old_per_token_logps"] = base + torch.randn(mask.size(0), 1,
                                                       generator=torch.Generator().manual_seed(1)) * 0.1
    trainer.model.train()
    saved_rule, saved_type = trainer._fspo_rule, trainer.loss_type
    trainer._fspo_rule = VESPOClip(value="verl")
    try:
        ours = trainer._compute_loss(trainer.model, inputs)
        g_ours = model_grads(trainer, ours)
        trainer.loss_type = "vespo"
        theirs = GRPOTrainer._compute_loss(trainer, trainer.model, inputs)
        g_theirs = model_grads(trainer, theirs)
    finally:
        trainer._fspo_rule, trainer.loss_type = saved_rule, saved_type
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-8)
    assert_same_grads(g_ours, g_theirs)


@pytest.mark.slow
def test_clip_rule_ema_band_observes_training_batches(run):
    """FSPO's EMA band through clip_rule: its sigma_hat (a buffer of the trainer's rule) moves with each training
    micro-batch's spread of S / sqrt(L), and the band in effect follows it."""
    from fspo.clipping.fspo import FSPOClip

    trainer, captured = run
    inputs = copy.deepcopy(captured[1])
    with torch.no_grad():
        base = logps_of(trainer, inputs)
    inputs["old_per_token_logps"] = base + torch.randn(inputs["completion_mask"].size(0), 1,
                                                       generator=torch.Generator().manual_seed(2)) * 0.5
    trainer.model.train()
    saved = trainer._fspo_rule
    trainer._fspo_rule = FSPOClip(band="ema", z=1.0, sigma0=0.03)
    try:
        trainer._compute_loss(trainer.model, inputs)
        sigma = float(trainer._fspo_rule.sigma_hat)
    finally:
        trainer._fspo_rule = saved
    assert sigma > 0.03  # S / sqrt(L) spread by the 0.5-nat shifts: the EMA moved up from sigma0


def test_config_paper_defaults_and_refusals(tmp_path):
    kw = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    c = FSPOConfig(**kw)
    assert (c.c_upper, c.c_lower, c.c_dual, c.ratio_grad) == (0.03, 0.03, 0.03, "per_token")
    assert (c.learning_rate, c.weight_decay, c.num_generations, c.beta, c.loss_type) == (1e-6, 0.01, 16, 0.0, "dapo")
    assert c.per_device_train_batch_size == 16 and c.max_grad_norm == 1.0 and c.temperature == 1.0
    assert c.lr_scheduler_type == "constant" or str(c.lr_scheduler_type).endswith("constant")
    for bad, match in ((dict(loss_type="cispo"), "loss_type='cispo'"),
                       (dict(importance_sampling_level="sequence"), "importance_sampling_level"),
                       (dict(delta=2.0), "delta"), (dict(entropy_coef=0.1), "entropy"),
                       (dict(c_upper=0.05, c_dual=0.03), "c_dual"), (dict(c_lower=-1.0), "c_lower")):
        with pytest.raises(ValueError, match=match) as e:
            FSPOConfig(**kw, **bad)
        assert "\n" not in str(e.value)


def test_trainer_refuses_a_plain_grpo_config_before_loading(tmp_path):
    from trl import GRPOConfig

    from fspo.integrations.trl import FSPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", loss_type="cispo")
    with pytest.raises(ValueError, match="loss_type='cispo'"):  # not the missing model's error
        FSPOTrainer(model=str(tmp_path / "no_such_model"), reward_funcs=example.answer_reward, args=args)


def test_clip_rule_builds_or_is_one_line(tmp_path):
    kw = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    assert FSPOConfig(**kw, clip_rule={"_target_": "fspo.clipping.vespo.VESPOClip"}).clip_rule
    for bad, match in (({"_target_": "fspo.clipping.vespo.VESPOClip", "k_pos": -1.0}, "k_pos must be"),
                       ({"_target_": "fspo.losses.Aggregator"}, "not a fspo.clipping ClipRule")):
        with pytest.raises(ValueError, match=match) as e:
            FSPOConfig(**kw, clip_rule=bad)
        assert "\n" not in str(e.value)
