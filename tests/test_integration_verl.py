"""fspo.integrations.verl against verl 0.9.1 itself (installed by .ci/run; skips without it).

- verl's own ``get_policy_loss_fn("fspo")`` after the import equals our registry's ``fspo``: loss,
  gradient and verl's three metrics, in every aggregation mode, with verl's default and global
  denominators, settings from an `FSPOPolicyLossConfig` inside a real ActorConfig;
- verl's rollout-correction weights multiply FSPO's token loss (hand-checked on one batch);
- the per-length counts, hand-computed on a 3-sequence batch, form a fixed key set;
- after verl's own reduction (Metric MEAN per micro-batch, Metric.aggregate_dp over ranks,
  reduce_metrics over mini-batches) the counts still give the exact per-length clip fraction;
- in a fresh process, ``VERL_USE_EXTERNAL_MODULES=fspo.integrations.verl`` alone registers it: the
  docs' CPU check benchmarks/verl_fspo_check.py (verl's Hydra config with the recipe's overrides).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from conftest import REPO

verl = pytest.importorskip("verl", reason="verl is not installed; .ci/run installs it")
if verl.__version__ != "0.9.1":  # pragma: no cover
    pytest.skip(f"these tests pin verl 0.9.1, found {verl.__version__}", allow_module_level=True)

from verl.trainer.ppo import core_algos  # noqa: E402
from verl.utils.metric import AggregationType, Metric, reduce_metrics  # noqa: E402
from verl.workers.config import ActorConfig  # noqa: E402

import fspo.integrations.verl as plugin  # noqa: E402
from fspo.clipping import FSPOClip  # noqa: E402
from fspo.clipping.registry import get_policy_loss_fn  # noqa: E402
from fspo.losses import AGG_MODES, aggregate  # noqa: E402

INFOS = {
    "local": {},
    "global": {"dp_size": 1, "batch_num_tokens": 700, "global_batch_size": 30, "loss_scale_factor": 64},
    "dp2": {"dp_size": 2, "batch_num_tokens": 1400, "global_batch_size": 60, "loss_scale_factor": 48},
}
SETTINGS = {"c_upper": 0.02, "c_lower": 0.025, "c_dual": 0.04}


def actor(info=None, **policy):
    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
                       global_batch_info=dict(info or {}), policy_loss=plugin.FSPOPolicyLossConfig(**policy))


def batch(seed, B=16, T=40):
    """Sequence log-ratios S_i ~ N(0, (0.04 sqrt L)^2): around FSPO's band, so it binds on some rows."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[1] = 0
    m = (torch.arange(T) < lengths[:, None]).float()
    old = -torch.rand(B, T, generator=g) * 3
    s = torch.randn(B, generator=g) * 0.04 * lengths.clamp(min=1).sqrt()
    new = old + (s / lengths.clamp(min=1))[:, None] + torch.randn(B, T, generator=g) * 0.01
    adv = torch.randn(B, generator=g)[:, None] * m
    return old, new, adv, m


def grad_of(fn, new):
    x = new.detach().clone().requires_grad_(True)
    loss, metrics = fn(x)
    return loss, metrics, torch.autograd.grad(loss, x)[0]


def test_import_registers_fspo_in_verl():
    assert core_algos.get_policy_loss_fn("fspo") is plugin.compute_policy_loss_fspo
    assert plugin.FSPOPolicyLossConfig().loss_mode == "fspo"
    assert (plugin.FSPOPolicyLossConfig().c_upper, plugin.FSPOPolicyLossConfig().c_dual) == (0.03, 0.03)


@pytest.mark.parametrize("info", list(INFOS))
@pytest.mark.parametrize("mode", AGG_MODES)
def test_verl_fspo_equals_registry(mode, info):
    old, new, adv, m = batch(0)
    cfg = actor(INFOS[info], **SETTINGS)
    verl_fn = core_algos.get_policy_loss_fn("fspo")
    loss, metrics, g = grad_of(lambda x: verl_fn(old_log_prob=old, log_prob=x, advantages=adv, response_mask=m,
                                                 loss_agg_mode=mode, config=cfg, rollout_is_weights=None), new)
    ref, ref_metrics, g_ref = grad_of(
        lambda x: get_policy_loss_fn("fspo")(old, x, adv, m, mode, {**SETTINGS, "global_batch_info": INFOS[info]}),
        new)
    torch.testing.assert_close(loss, ref, rtol=1e-7, atol=0)
    torch.testing.assert_close(g, g_ref, rtol=1e-7, atol=0)
    for k, v in ref_metrics.items():
        assert metrics[k] == v, k
    res = FSPOClip(**SETTINGS)(new, old, adv, m)
    assert res.clip_upper.any() and res.clip_lower.any() and not res.clipped[m.bool()].all()
    assert 0 < metrics["actor/pg_clipfrac"] < 1
    n_seq = {k: v for k, v in metrics.items() if k.startswith("actor/fspo/n_seq/")}
    assert len(n_seq) == 42 and sum(n_seq.values()) == 15  # bins of 200 up to 8192 + overflow; 1 empty row


def test_rollout_is_weights_multiply_the_token_loss():
    old, new, adv, m = batch(1)
    w = 0.5 + torch.rand(m.shape, generator=torch.Generator().manual_seed(3))
    loss, _ = core_algos.get_policy_loss_fn("fspo")(old, new, adv, m, "token-mean", actor(), rollout_is_weights=w)
    res = FSPOClip()(new, old, adv, m)  # the paper's settings: the config's defaults
    torch.testing.assert_close(loss, aggregate(res.token_loss * w, m, "token-mean").loss)
    assert (loss - aggregate(res.token_loss, m, "token-mean").loss).abs() > 1e-4


def test_per_length_counts_hand_computed():
    # L = 3, 5, 250 with the paper's band c = 0.03: half-widths 0.052, 0.067, 0.474.
    # seq 0: S = 0.1, A > 0 -> upper clip, out of band; seq 1: S = 0, in band;
    # seq 2: S = -1, A < 0 -> lower clip, out of band. Bins of 200: {0, 1} in [0, 200), {2} in [200, 400).
    T = 250
    lengths = torch.tensor([3, 5, 250])
    m = (torch.arange(T) < lengths[:, None]).float()
    old = torch.full((3, T), -1.0)
    new = old + (torch.tensor([0.1, 0.0, -1.0]) / lengths)[:, None] * m
    adv = torch.tensor([1.0, 1.0, -1.0])[:, None] * m
    _, metrics = core_algos.get_policy_loss_fn("fspo")(old, new, adv, m, "token-mean", actor())
    got = {k: v for k, v in metrics.items() if k.startswith("actor/fspo/") and v != 0}
    assert got == {"actor/fspo/n_seq/len_00000_00200": 2.0, "actor/fspo/n_clip/len_00000_00200": 1.0,
                   "actor/fspo/n_out/len_00000_00200": 1.0, "actor/fspo/n_seq/len_00200_00400": 1.0,
                   "actor/fspo/n_clip/len_00200_00400": 1.0, "actor/fspo/n_out/len_00200_00400": 1.0}
    assert len([k for k in metrics if k.startswith("actor/fspo/")]) == 3 * 42
    small = actor(length_bin_width=2, length_bin_max=6)
    _, metrics = core_algos.get_policy_loss_fn("fspo")(old, new, adv, m, "token-mean", small)
    assert {k.rsplit("/", 1)[1] for k in metrics if k.startswith("actor/fspo/n_seq/")} == {
        "len_00000_00002", "len_00002_00004", "len_00004_00006", "len_00006_inf"}


def test_counts_stay_exact_through_verls_reduction():
    """2 mini-batches x 2 ranks x 3 micro-batches of unequal composition, reduced as verl reduces."""
    old, new, adv, m = batch(2, B=48, T=120)
    cfg = actor(length_bin_width=40, length_bin_max=120)
    fn = core_algos.get_policy_loss_fn("fspo")
    chunks = torch.arange(48).split([2, 5, 9, 4, 4, 0 + 8, 3, 3, 1, 2, 6, 1])
    per_mb = []  # mini-batch -> rank -> {key: Metric over its micro-batches}
    for mb in range(2):
        ranks = []
        for rank in range(2):
            acc = {}
            for micro in range(3):
                idx = chunks[mb * 6 + rank * 3 + micro]
                _, metrics = fn(old[idx], new[idx], adv[idx], m[idx], "token-mean", cfg)
                for k, v in Metric.from_dict(metrics, aggregation=AggregationType.MEAN).items():
                    acc.setdefault(k, Metric(AggregationType.MEAN)).extend(v)
            ranks.append(acc)
        per_mb.append({k: Metric.aggregate_dp([r[k] for r in ranks]) for k in ranks[0]})
    reduced = reduce_metrics({k: [d[k] for d in per_mb] for k in per_mb[0]})
    frac = plugin.by_length_fractions(reduced)
    res = FSPOClip()(new, old, adv, m)
    lengths = m.sum(-1)
    clipped = res.clipped.any(-1).float()
    for b, label in enumerate(plugin.length_bins(cfg).labels):
        lo = 40 * b
        sel = (lengths >= max(lo, 1)) & ((lengths < lo + 40) if b < 3 else torch.ones_like(lengths, dtype=torch.bool))
        if sel.any():
            expect = clipped[sel].double().mean().item()
            assert frac[f"actor/fspo/clip_frac/{label}"] == pytest.approx(expect, abs=1e-12), label
    assert 0 < sum(frac[k] for k in frac if "clip_frac" in k)


DOCS_CHECK = "VERL_USE_EXTERNAL_MODULES=fspo.integrations.verl python benchmarks/verl_fspo_check.py"


@pytest.mark.slow
def test_env_var_registers_in_a_fresh_process_and_docs_check_runs():
    """docs/integrations.md's CPU check, run as written (bash, ``python`` = this interpreter)."""
    assert DOCS_CHECK in (REPO / "docs" / "integrations.md").read_text()
    env = {**os.environ, "PYTHONPATH": str(REPO), "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}
    env.pop("VERL_USE_EXTERNAL_MODULES", None)
    out = subprocess.run(["bash", "-c", DOCS_CHECK], env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip().splitlines()[-1] == "OK"
    assert out.stdout.count(" same") == 3 and "FSPOPolicyLossConfig(loss_mode=fspo, c_upper=0.04" in out.stdout
    # without the variable nothing registers it: the check says so
    out = subprocess.run(["bash", "-c", DOCS_CHECK.split(" ", 1)[1]], env=env, capture_output=True, text=True,
                         timeout=600, cwd=REPO)
    assert out.returncode == 1 and "VERL_USE_EXTERNAL_MODULES" in out.stderr


def test_running_ema_band_keeps_its_state_between_calls():
    """band=ema: the plugin's loss on call k equals FSPOClip(band="ema") after the same k - 1 observed batches
    (one observe per call with a gradient); a call without a gradient leaves the state alone."""
    plugin._RULES.clear()
    cfg = actor({}, band="ema", z=1.5, alpha=0.5, sigma0=0.02)
    ref = FSPOClip(band="ema", z=1.5, alpha=0.5, sigma0=0.02)
    fn = core_algos.get_policy_loss_fn("fspo")
    for seed in (4, 5, 6):
        old, new, adv, m = batch(seed)
        loss, metrics, g = grad_of(lambda x, o=old, a=adv, mm=m: fn(o, x, a, mm, "token-mean", cfg), new)
        x = new.detach().clone().requires_grad_(True)
        res = ref(x, old, adv, m)
        want = aggregate(res.token_loss, m, "token-mean").loss
        torch.testing.assert_close(loss, want, rtol=1e-7, atol=0)
        torch.testing.assert_close(g, torch.autograd.grad(want, x)[0], rtol=1e-7, atol=0)
        assert metrics["actor/fspo/sigma_hat"] == pytest.approx(float(ref.sigma_hat))
        mb = m.bool()
        ref.observe(res.seq_log_ratio, mb.sum(-1), (new - old).float() * mb, mb)
    assert float(ref.sigma_hat) != 0.02  # the band moved
    before = float(next(iter(plugin._RULES.values())).sigma_hat)
    fn(old, new, adv, m, "token-mean", cfg)  # no gradient: a metrics pass
    assert float(next(iter(plugin._RULES.values())).sigma_hat) == before
    plugin._RULES.clear()
