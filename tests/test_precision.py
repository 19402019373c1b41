"""Float32 master weights: the rounding that makes bf16 weights learn nothing at lr 1e-6,
its refusal before any work, the engine's generation dtype, and ``train/update_ratio`` by hand.

fspo/runtime/launch/precision.py and fspo/update/update_ratio.py; the end-to-end checks (every method logs
update_ratio > 0 at every step; 2 FSDP ranks equal one process) are in tests/test_train_methods.py and
tests/test_fsdp.py.
"""
from __future__ import annotations

import pytest
import torch

from conftest import compose_config, register_entry_case
from fspo.runtime.checks.config_check import ConfigError, check_config
from fspo.runtime.launch.precision import engine_dtype, master_weight_problem, weight_step
from fspo.update.update_ratio import UpdateRatio


def test_weight_step_by_hand():
    # 0.02 lies in [2^-6, 2^-5): ulp = 2^(-6 - mantissa bits)
    assert weight_step("bfloat16") == 2.0 ** -13 == pytest.approx(1.2207e-4, rel=1e-4)
    assert weight_step("float16") == 2.0 ** -16
    assert weight_step("float32") == 2.0 ** -29
    assert weight_step("bfloat16", 1.0) == 2.0 ** -7
    # the premise, with torch's own rounding: a bf16 0.02 ignores 1e-6 and 6e-5, keeps 6.2e-5 (> ulp / 2)
    w = torch.tensor(0.02, dtype=torch.bfloat16)
    assert w + 1e-6 == w and w + 6.0e-5 == w and w + 6.2e-5 != w


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_one_adamw_step_at_lr_1e6_moves_float32_weights_only(dtype):
    torch.manual_seed(0)
    w = torch.nn.Parameter((torch.randn(1000) * 0.02).to(getattr(torch, dtype)))
    before = w.detach().clone()
    opt = torch.optim.AdamW([w], lr=1e-6, weight_decay=0.0)
    w.grad = torch.randn_like(w)
    opt.step()
    moved = (w.detach() != before).float().mean().item()
    if dtype == "bfloat16":
        assert moved < 0.05  # only weights below ~5e-4 in size can take a step of 1e-6
    else:  # Adam's first step is lr * sign(g) (|m / sqrt(v)| = 1): every weight moves by 1e-6
        assert moved == 1.0
        assert (w.detach() - before).abs().double().mean().item() == pytest.approx(1e-6, rel=1e-2)


def test_master_weight_problem_thresholds():
    assert master_weight_problem("float32", 1e-9) is None
    assert master_weight_problem("bfloat16", 1e-4) is None  # >= 2^-13 / 2 = 6.1e-5
    assert master_weight_problem("float16", 1e-5) is None   # >= 2^-16 / 2 = 7.6e-6
    assert master_weight_problem("bfloat16", 1e-6, trainable=False) is None  # e.g. a frozen base under LoRA
    msg = master_weight_problem("bfloat16", 2e-5)
    assert msg.startswith("model.dtype=bfloat16 with ppo.lr=2e-05:") and "1.22e-04" in msg
    assert "float32 master weights" in msg and "set model.dtype=float32" in msg
    assert master_weight_problem("float16", 1e-6) is not None


def test_check_config_refuses_bf16_weights_at_lr_1e6_and_passes_the_presets():
    with pytest.raises(ConfigError, match=r"^model.dtype=bfloat16 with ppo.lr=1e-06: .*float32 master weights"):
        check_config(compose_config(["model.dtype=bfloat16", "ppo.lr=1e-6"]))
    for overrides in (["+model=qwen3_8b"], ["+model=qwen3_1_7b", "ppo.lr=1e-6"],
                      ["+experiment=paper_qwen3_8b"], ["+experiment=paper_8xh200"]):
        check_config(compose_config(overrides))  # float32 masters everywhere: nothing refused


register_entry_case("precision/bf16", ["model.dtype=bfloat16", "ppo.lr=1e-6", "output_dir={dir}/out",
                                       "logger.tracking_uri=sqlite:///{dir}/m.db"])


@pytest.mark.slow
def test_run_py_refuses_in_one_line_before_any_work(entry_case):
    proc, _, folder = entry_case("precision/bf16")  # experiments/run.py in conftest's `entry_case` interpreter
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "float32 master weights" in lines[0]
    assert not (folder / "m.db").exists() and not (folder / "out" / "checkpoints").exists()


def test_engine_dtype_rule():
    assert engine_dtype("auto", "float32", on_gpu=True) == "bfloat16"   # generation in bf16 on GPUs
    assert engine_dtype("auto", "float32", on_gpu=False) == "float32"   # CPU: the policy's own dtype
    assert engine_dtype("float32", "float32", on_gpu=True) == "float32"  # float32 stays an option
    assert engine_dtype("bfloat16", "float32", on_gpu=False) == "bfloat16"


def test_update_ratio_by_hand():
    a = torch.nn.Parameter(torch.tensor([1.0, 2.0, 2.0]))   # |a| = 3
    b = torch.nn.Parameter(torch.tensor([4.0]))             # |(a, b)| = 5
    frozen = torch.nn.Parameter(torch.tensor([100.0]), requires_grad=False)
    r = UpdateRatio()
    r.snapshot([a, frozen, b])
    with torch.no_grad():
        a[2] += 0.3
        b[0] += 0.4          # |delta| = sqrt(0.09 + 0.16) = 0.5
        frozen[0] = -7.0     # not trainable: not counted
    assert r.compute([a, frozen, b]) == pytest.approx(0.5 / 5.0, rel=1e-6)
    r.snapshot([a, b])
    assert r.compute([a, b]) == 0.0  # nothing moved
    with pytest.raises(RuntimeError, match="before snapshot"):
        r.compute([a, b])


def test_update_ratio_sees_bf16_rounding_away():
    """The metric shows the silent no-learning: 0 for bf16 weights at lr 1e-6, > 0 for float32."""
    for dtype, expect_zero in ((torch.bfloat16, True), (torch.float32, False)):
        torch.manual_seed(0)
        w = torch.nn.Parameter((torch.rand(256) * 0.02 + 0.01).to(dtype))  # sizes 0.01 .. 0.03
        opt = torch.optim.AdamW([w], lr=1e-6, weight_decay=0.0)
        r = UpdateRatio()
        r.snapshot([w])
        w.grad = torch.randn_like(w)
        opt.step()
        ratio = r.compute([w])
        assert (ratio == 0.0) == expect_zero, (dtype, ratio)


@pytest.mark.slow
def test_default_run_moves_the_weights_at_every_step(compose_cfg, mlflow_uri):
    """The default (warm-started tiny model, FSPO, CPU) logs train/update_ratio > 0 at every RL step. (A
    random model scores 0 everywhere, so its advantages and gradients are 0 and its ratio is exactly 0.)"""
    import mlflow

    from fspo.train import train

    train(compose_cfg(["steps=2", "val.size=0", "logger.experiment_name=test_update_ratio"]))  # the default's batch
    client = mlflow.MlflowClient(tracking_uri=mlflow_uri)
    exp = client.get_experiment_by_name("test_update_ratio")
    run = client.search_runs([exp.experiment_id])[0]
    hist = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/update_ratio"))
    assert [s for s, _ in hist] == [0, 1]
    # Adam moves each weight by <= ~lr 2e-5 per update, 4 updates a step: a ratio of order 1e-4
    assert all(0 < v < 1e-2 for _, v in hist), hist
