"""The divergence guard (fspo/update/guard.py).

Owns: the limit arithmetic and the four actions; ``stop`` ends a diverging run with one line naming
the measure, its limit and ppo.lr, with the checkpoints and metrics written before kept and the MLflow
run FAILED; ``skip`` drops updates exactly (parameters and AdamW state as if never stepped); the
default config guards with loose limits that a healthy run stays far below; under two data-parallel
ranks every rank reaches the same verdict (a breach seen on one rank only skips the update on both)
and a real FSDP step with a skipped update equals one process. Leaves out: non-finite values
(test_numerics_guard.py).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, SMALL
from fspo.runtime.checkpoints.files import list_checkpoints
from fspo.update import forward as passes
from fspo.update.guard import DivergenceError, DivergenceGuard, UpdateMeter

BASE = [o for o in SMALL if not o.startswith("steps=")] + ["reward._target_=test_resume.DigitReward"]


def meter(loss_sum=0.0, kl_sum=0.0, tokens=10.0) -> UpdateMeter:
    m = UpdateMeter()
    m.loss_sum, m.kl_sum, m.tokens = loss_sum, kl_sum, tokens
    return m


def test_breaches_name_measure_value_and_limit():
    g = DivergenceGuard(max_grad_norm=10.0, max_loss=5.0, max_kl=1.0)
    assert g.breaches(1.0, -4.9, 0.5) == []
    assert g.breaches(11.0, -6.0, 2.0) == ["grad norm 11 > guard.max_grad_norm=10", "loss 6 > guard.max_loss=5",
                                           "KL 2 > guard.max_kl=1"]
    assert DivergenceGuard(max_grad_norm=None, max_loss=None, max_kl=1.0).breaches(1e9, 1e9, 0.1) == []


def test_actions():
    big = meter(kl_sum=50.0)  # KL 5 per token
    with pytest.raises(DivergenceError, match=r"at RL step 3, update 2: KL 5 > guard.max_kl=1\..*ppo.lr \(now 0.5\)"):
        DivergenceGuard().check(torch.tensor(1.0), big, where="RL step 3, update 2", lr=0.5)
    assert DivergenceGuard(action="skip").check(torch.tensor(1.0), big) == "skip"
    assert DivergenceGuard(action="warn").check(torch.tensor(1.0), big) == "warn"
    assert DivergenceGuard(action="off").check(torch.tensor(1e30), big) == "step"
    assert DivergenceGuard().check(torch.tensor(1.0), meter(kl_sum=0.1)) == "step"
    with pytest.raises(ValueError, match="guard.action"):
        DivergenceGuard(action="halt")


def test_meter_kl_is_k3_of_the_masked_tokens():
    m = UpdateMeter()
    logp = torch.tensor([[-1.0, -2.0, -3.0]])
    old = torch.tensor([[-1.0, -1.0, 0.0]])
    m.add(torch.tensor([[1.0, 3.0, 100.0]]), logp, old, torch.tensor([[1, 1, 0]]))
    d = torch.tensor(-1.0)
    assert m.tokens == 0.0  # summed on the device until flushed: one host read per update, not three per micro-batch
    m.flush()
    assert m.tokens == 2 and m.loss_sum == 4.0
    assert m.kl_sum == pytest.approx(float(torch.exp(d) - 1 - d))


def inject_divergence(monkeypatch, at_step: int) -> None:
    """From RL step ``at_step`` on, every log-prob the trainer computes is 30 nats lower: the policy looks
    far from the one that sampled the batch (per-token KL ~19, as after a huge learning rate)."""
    original = passes.log_probs

    def log_probs(module, batch, with_entropy=False, **kw):
        logp, ent = original(module, batch, with_entropy, **kw)
        return (logp - 30.0 if int(module.rl_step) >= at_step else logp), ent

    monkeypatch.setattr(passes, "log_probs", log_probs)


def test_stop_ends_the_run_with_one_line_and_keeps_what_was_written(compose_cfg, monkeypatch):
    from mlflow.tracking import MlflowClient

    from fspo.runtime.checks.errors import user_error
    from fspo.train import train

    cfg = compose_cfg(BASE + ["steps=3", "checkpoint.every_n_steps=1", "val.size=0"])
    assert cfg.guard.action == "stop"  # on by default
    inject_divergence(monkeypatch, at_step=1)
    with pytest.raises(DivergenceError) as e:
        train(cfg)
    line = user_error(e.value)
    assert "\n" not in line and "RL step 1, update 1" in line and "guard.max_kl=1" in line and "ppo.lr" in line
    out = Path(cfg.output_dir)
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == ["step_000001.ckpt"]
    client = MlflowClient(cfg.logger.tracking_uri)
    run = client.get_run((out / "mlflow_run_id").read_text().strip())
    assert run.info.status == "FAILED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [0]


def _policy_state(ckpt: Path) -> dict:
    ck = torch.load(ckpt, weights_only=True)
    return ck, {k[len("policy."):]: v for k, v in ck["state_dict"].items() if k.startswith("policy.")}


@pytest.mark.parametrize("action", ["skip", "warn"])
def test_skip_drops_updates_exactly(action, compose_cfg):
    """Every update past the limit: ``skip`` leaves parameters bit-identical and AdamW without state;
    ``warn`` (the control) steps them."""
    from fspo.models.tiny import build_tiny_model
    from fspo.train import train

    cfg = compose_cfg(BASE + ["steps=2", "val.size=0", "checkpoint.every_n_steps=0", f"guard.action={action}",
                              "guard.max_grad_norm=1e-12"])
    final = train(cfg)
    ck, params = _policy_state(list_checkpoints(Path(cfg.output_dir) / "checkpoints")[-1])
    initial = build_tiny_model(seed=int(cfg.seed)).state_dict()
    same = all(torch.equal(params[k], initial[k]) for k in initial)
    updates = 2 * 2  # steps x (16 sequences / mini-batch 8)
    if action == "skip":
        assert same and ck["optimizer_states"][0]["state"] == {}
        assert final["train/skipped_updates_total"] == updates and final["guard/trips"] == 2
    else:
        assert not same and final["train/skipped_updates_total"] == 0 and final["guard/trips"] == 2


def test_default_limits_are_loose(compose_cfg):
    """A healthy run (the default lr) stays far below the default limits: no trip, no skip."""
    from fspo.train import train

    cfg = compose_cfg(BASE + ["steps=2", "val.size=0", "checkpoint.every_n_steps=0"])
    final = train(cfg)
    assert final["guard/trips"] == 0 and final["train/skipped_updates_total"] == 0
    assert final["train/grad_norm"] < cfg.guard.max_grad_norm / 100 and final["train/kl"] < cfg.guard.max_kl / 10


@pytest.mark.distributed
@pytest.mark.slow  # torchrun, 2 processes: ~35 s on a loaded 2-core machine
def test_two_ranks_agree(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(REPO / "tests" / "guard_worker.py"), str(tmp_path)]
    proc = subprocess.run(cmd, env=env, cwd=str(REPO), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    verdicts = [json.loads((tmp_path / f"verdicts_{r}.json").read_text()) for r in (0, 1)]
    # a breach on rank 1 only, and one only in the all-reduced sums, skip the update on both ranks
    assert verdicts[0] == verdicts[1] == {"rank1_only": "skip", "global_only": "skip", "none": "step"}
    # one real FSDP step (2 updates; the second past guard.max_kl, skipped) equals one process
    import guard_worker

    one = guard_worker.run_guarded_step(1, tmp_path / "one")
    two = torch.load(tmp_path / "step_w2.pt", weights_only=False)
    assert one["skipped"] == two["skipped"] == 1 and one["trips"] == two["trips"] == 1
    from fspo.models.tiny import build_tiny_model

    init = build_tiny_model(seed=0).state_dict()
    assert max(float((v - init[k]).abs().max()) for k, v in one["params"].items()) > 1e-4  # update 1 stepped
    for k, v in one["params"].items():  # AdamW's first step amplifies float noise where |g| < eps: 1.3e-5
        torch.testing.assert_close(two["params"][k], v, rtol=0, atol=5e-5)  # measured (tests/test_fsdp.py)
