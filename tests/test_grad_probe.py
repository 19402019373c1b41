"""The per-length gradient probe (fspo/update/grad_probe.py): ||g*_L||, the within-bin and batch cosines of
Theorem 1, kappa, LRE and LRE_w with the measured norms, on a linear toy policy whose per-sequence gradients
are written by hand; the partition LRE by hand; the tiny model on-policy (nothing clipped: cos 1, LRE 0)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_report import store  # noqa: F401  (the report test's MLflow store fixture)

from fspo.clipping.fspo import FSPOClip
from fspo.diagnostics.bins import LengthBins
from fspo.update.grad_probe import gradient_probe, partition_lre

# logp_it = theta . x_it (theta in R^2), old = logp - d; FSPO's fixed band |S| <= 0.03 sqrt(L), A = 1 (upper clip)
ROWS = [([[1, 0]], [0.0]),                      # L 1: S 0, in band: u = c = -(1, 0)
        ([[0, 2]], [0.1]),                      # L 1: S 0.1 > 0.03: clipped: u = -e^0.1 (0, 2), c = 0
        ([[1, 0], [1, 0], [1, 0]], [0, 0, 0]),  # L 3: u = c = -(3, 0)
        ([[0, 1], [0, 0], [0, 1]], [0.01, 0, 0]),  # L 3: S 0.01 <= 0.052: u = c = -e^0.01 (0, 2)
        ([[1, 1], [0, 0], [0, 0]], [0, 0, 0.06])]  # L 3: S 0.06 > 0.052: clipped: u = -e^0.06 (1, 1), c = 0
U = [np.array(v) for v in ([-1, 0], [0, -2 * math.e ** 0.1], [-3, 0], [0, -2 * math.e ** 0.01],
                           [-math.e ** 0.06, -math.e ** 0.06])]
C = [U[0], np.zeros(2), U[2], U[3], np.zeros(2)]


def toy():
    theta = torch.tensor([0.3, -0.2], requires_grad=True)
    x = torch.zeros(5, 3, 2)
    d = torch.zeros(5, 3)
    m = torch.zeros(5, 3)
    for i, (xs, ds) in enumerate(ROWS):
        x[i, :len(xs)] = torch.tensor(xs, dtype=torch.float32)
        d[i, :len(ds)] = torch.tensor(ds)
        m[i, :len(xs)] = 1
    logp = (x * theta).sum(-1) * m
    return theta, logp, (logp.detach() - d) * m, m


def cos(a, b):
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_probe_by_hand():
    theta, logp, old, m = toy()
    bins = LengthBins(width=2, max_len=4)  # [0, 2): rows 0-1; [2, 4): rows 2-4
    out = gradient_probe(logp, old, torch.ones(5), m, FSPOClip(), [theta], bins)
    g0, g1 = (U[0] + U[1]) / 2, (U[2] + U[3] + U[4]) / 3
    c0, c1 = (C[0] + C[1]) / 2, (C[2] + C[3] + C[4]) / 3
    (k0, k1) = [k for k in bins.labels if f"probe/gnorm/{k}" in out]
    assert out[f"probe/gnorm/{k0}"] == pytest.approx(np.linalg.norm(g0), rel=1e-5)
    assert out[f"probe/gnorm/{k1}"] == pytest.approx(np.linalg.norm(g1), rel=1e-5)
    assert out[f"probe/cos/{k0}"] == pytest.approx(cos(c0, g0), rel=1e-5)  # 0.5 / |g0| = 0.4122
    assert out[f"probe/cos/{k1}"] == pytest.approx(cos(c1, g1), rel=1e-5)
    assert (out[f"probe/q/{k0}"], out[f"probe/q/{k1}"]) == (0.5, pytest.approx(2 / 3))
    g, c = (2 * g0 + 3 * g1) / 5, (2 * c0 + 3 * c1) / 5
    assert out["probe/cos"] == pytest.approx(cos(c, g), rel=1e-5)
    kappa = (2 * np.linalg.norm(g0) + 3 * np.linalg.norm(g1)) / 5 / np.linalg.norm(g)
    assert out["probe/kappa"] == pytest.approx(kappa, rel=1e-5)
    q_bar = (2 * 0.5 + 3 * 2 / 3) / 5  # 0.6
    dev = [abs(0.5 / q_bar - 1), abs(2 / 3 / q_bar - 1)]  # 1/6, 1/9
    assert out["probe/lre"] == pytest.approx(0.5 * (2 * dev[0] + 3 * dev[1]) / 5)
    w = [2 * np.linalg.norm(g0), 3 * np.linalg.norm(g1)]
    assert out["probe/lre_w"] == pytest.approx(0.5 * (w[0] * dev[0] + w[1] * dev[1]) / sum(w), rel=1e-5)
    assert theta.grad is None  # the parameters' .grad is untouched


def test_partition_lre_by_hand():
    # cells 0: q = 1 (n 2), 1: q = 2/3 (n 3); q_bar 0.8; 0.5 (2 x 0.25 + 3 x 1/6) / 5 = 0.1
    assert partition_lre(torch.tensor([0, 1, 0, 1, 1]), torch.tensor([1.0, 0, 1, 1, 1])) == pytest.approx(0.1)
    theta, logp, old, m = toy()
    out = gradient_probe(logp, old, torch.ones(5), m, FSPOClip(), [theta], LengthBins(width=2, max_len=4),
                         partition=torch.tensor([0.0, 0.0, 1.0, 1.0, 1.0]))  # the partition is the bins here
    assert out["probe/partition_lre"] == pytest.approx(out["probe/lre"])


def test_tiny_model_on_policy_nothing_clipped():
    from test_module_update import make_rollout

    from fspo.models.tiny import build_tiny_model
    from fspo.update.logprobs import response_log_probs

    model = build_tiny_model(seed=0)
    batch = make_rollout()
    logp, _ = response_log_probs(model, batch)
    out = gradient_probe(logp, logp.detach(), batch.advantages, batch.response_mask, FSPOClip(),
                         list(model.parameters()), LengthBins(width=4, max_len=12), partition=batch.rewards)
    assert out["probe/cos"] == pytest.approx(1.0, abs=1e-6) and out["probe/lre"] == 0.0 and out["probe/lre_w"] == 0.0
    assert out["probe/kappa"] >= 1.0 - 1e-9  # E||g_L|| >= ||E g_L|| (triangle inequality)
    assert all(v > 0 for k, v in out.items() if k.startswith("probe/gnorm/"))


def test_training_step_logs_the_probe_on_its_last_mini_batch():
    """RLModule(probe_every=1): one RL step of 2 mini-batches logs probe/* (the second mini-batch is off-policy)."""
    import test_module_update as tmu
    from test_module_update import make_rollout, run_update

    orig = tmu.RLModule.__init__

    def with_probe(self, *a, **kw):
        kw["probe_every"] = 1
        orig(self, *a, **kw)

    tmu.RLModule.__init__ = with_probe
    try:
        _, _, metrics = run_update(make_rollout(), clip_name="fspo", mini_batch_size=4)
    finally:
        tmu.RLModule.__init__ = orig
    assert -1.0 <= metrics["probe/cos"] <= 1.0 and metrics["probe/kappa"] >= 1.0 - 1e-9
    assert {"probe/lre", "probe/lre_w", "probe/partition_lre"} <= set(metrics)
    assert any(k.startswith("probe/gnorm/") for k in metrics)
    _, _, plain = run_update(make_rollout(), clip_name="fspo", mini_batch_size=4)
    assert not any(k.startswith("probe/") for k in plain)  # off by default
    with pytest.raises(ValueError, match="grad_probe_every must be >= 0"):
        tmu.RLModule(policy=None, clip=None, aggregator=None, ppo=tmu.PPOConfig(), diagnostics=None, probe_every=-1)


def test_report_reads_the_probe(store, tmp_path, capsys):  # noqa: F811
    """fairness.csv / report.md carry LRE_w with the measured ||g_L||, cos(g^b, g*) and the group-reward LRE
    (each run's last probed step), averaged over the group's runs."""
    import csv

    from test_report import _report

    uri, exp, client = store
    runs = client.search_runs([client.get_experiment_by_name(exp).experiment_id],
                              "tags.method = 'fspo' and attributes.status = 'FINISHED'")
    for r, v in zip(runs, (0.02, 0.04)):
        client.log_metric(r.info.run_id, "probe/lre_w", 1.0, step=1)
        client.log_metric(r.info.run_id, "probe/lre_w", v, step=2)  # the last probed step counts
        client.log_metric(r.info.run_id, "probe/cos", 0.9, step=2)
        client.log_metric(r.info.run_id, "probe/partition_lre", 0.1, step=2)
    out = tmp_path / "report"
    proc = _report(capsys, uri, out, "--experiment", exp, "--no-log")
    assert proc.returncode == 0, proc.stderr[-3000:]
    fair = {r["group"]: r for r in csv.DictReader(open(out / "fairness.csv"))}
    assert float(fair["fspo"]["lre_w_grad"]) == pytest.approx(0.03) and float(fair["fspo"]["probe_cos"]) == 0.9
    assert fair["rloo"]["lre_w_grad"] == ""  # no probe: empty
    assert "| 0.0300 | 0.900 | 0.1000 |" in (out / "report.md").read_text()


def test_group_reward_is_the_groups_mean():
    from fspo.update.grad_probe import group_reward

    assert group_reward(torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1])).tolist() == [0.5, 0.5, 1.0, 1.0]
    assert group_reward(torch.tensor([1.0, 0.0]), None).tolist() == [1.0, 0.0]
