"""Rewards that cannot teach stop the run: NaN, failing on every sample, raising too often.

Owns: `check_reward_health`'s policy on hand-made counts, `guarded_reward`'s ``raised`` flags, the real
training loop on rewards that return NaN / always raise / raise on some samples (with and without
``reward_guard.max_error_frac``), and ``experiments/run.py reward.correct_reward=nan`` (exit 2, one line,
before any work). Leaves out: the reward functions' own maths (test_math_reward.py) and NaN log-probs
(test_numerics_guard.py).
"""
from __future__ import annotations

import pytest

from conftest import SMALL, register_entry_case
from fspo.rewards.base import RewardOutput
from fspo.rewards.guard import RewardFailure, check_reward_health, guarded_reward

BASE = [o for o in SMALL if not o.startswith("steps=")] + ["steps=1", "val.size=0"]


def test_health_policy_on_hand_counts(caplog):
    check_reward_health("r", 3, n=16, nonfinite=0, raised=0, errors=2)  # self-reported errors only: goes on
    with pytest.raises(RewardFailure, match=r"reward r returned a non-finite score .* 1 of 16 samples at step 3"):
        check_reward_health("r", 3, n=16, nonfinite=1, raised=0, errors=0)
    with pytest.raises(RewardFailure, match="failed on every one of the 16 samples"):
        check_reward_health("r", 3, n=16, nonfinite=0, raised=0, errors=16)
    with pytest.raises(RewardFailure, match=r"raised on 1 of 16 samples at step 3 \(6.2%\).*max_error_frac=0.07"):
        check_reward_health("r", 3, n=16, nonfinite=0, raised=1, errors=1, max_error_frac=0.0)
    check_reward_health("r", 3, n=16, nonfinite=0, raised=1, errors=1, max_error_frac=0.07)  # 1/16 = 0.0625 <= 0.07
    assert "raised on 1 of 16 samples at step 3" in caplog.text


def test_guarded_reward_flags_raising_samples():
    def flaky(completions, *a):
        if any("boom" in c for c in completions):
            raise RuntimeError("verifier crashed")
        return RewardOutput([1.0] * len(completions))

    out = guarded_reward(flaky, ["a", "boom", "c"], ["1"] * 3, [1] * 3, [False] * 3, 8)
    assert out.scores == [1.0, 0.0, 1.0] and out.errors == 1
    assert out.components["raised"] == [0.0, 1.0, 0.0] and out.components["nonfinite"] == [0.0, 0.0, 0.0]


class NanReward:
    def __init__(self, **_):
        pass

    def __call__(self, completions, *a):
        return RewardOutput([float("nan")] + [0.5] * (len(completions) - 1))


class AlwaysRaises:
    def __init__(self, **_):
        pass

    def __call__(self, completions, *a):
        raise KeyError("no such field")


class RaisesOnFirst:
    """Raises on the first completion of each call (so on 1 sample of the batch when scored one by one)."""

    calls = 0

    def __init__(self, **_):
        pass

    def __call__(self, completions, *a):
        RaisesOnFirst.calls += 1
        if RaisesOnFirst.calls in (1, 2):  # the batch call, then the first sample alone
            raise RuntimeError("bad sample")
        return RewardOutput([float(i % 2) for i in range(len(completions))])


@pytest.mark.parametrize("cls, match", [(NanReward, "test_reward_guard.NanReward returned a non-finite score"),
                                        (AlwaysRaises, "test_reward_guard.AlwaysRaises failed on every one")])
def test_training_stops_on_a_reward_that_cannot_teach(compose_cfg, cls, match):
    from fspo.runtime.checks.errors import user_error
    from fspo.train import train

    cfg = compose_cfg(BASE + [f"reward._target_={__name__}.{cls.__name__}"])
    with pytest.raises(RewardFailure) as e:
        train(cfg)
    msg = user_error(e.value)
    assert msg is not None and "\n" not in msg and match in msg, msg


@pytest.mark.slow  # > 2.5 s: out of the quick loop (-m "not slow"), still in CI
def test_some_raising_samples_stop_at_zero_threshold_and_go_on_above(compose_cfg, monkeypatch):
    from fspo.train import train

    monkeypatch.setattr(RaisesOnFirst, "calls", 0)
    cfg = compose_cfg(BASE + [f"reward._target_={__name__}.RaisesOnFirst"])
    with pytest.raises(RewardFailure, match=r"raised on 1 of 16 samples"):
        train(cfg)
    monkeypatch.setattr(RaisesOnFirst, "calls", 0)
    cfg = compose_cfg(BASE + [f"reward._target_={__name__}.RaisesOnFirst", "reward_guard.max_error_frac=0.1"])
    final = train(cfg)
    assert final["reward/errors"] == 1 and final["reward/raised"] == pytest.approx(1 / 16)


register_entry_case("reward_guard/nan", [*BASE, "reward.correct_reward=nan", "output_dir={dir}/out",
                                         "hydra.run.dir={dir}/h"], {"MLFLOW_TRACKING_URI": "sqlite:///{dir}/m.db"})


@pytest.mark.slow  # > 2.5 s: out of the quick loop (-m "not slow"), still in CI
def test_run_with_nan_reward_setting_exits_2_before_any_work(entry_case):
    p, _, folder = entry_case("reward_guard/nan")  # experiments/run.py in conftest's `entry_case` interpreter
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    lines = [x for x in p.stderr.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "reward.correct_reward=nan" in lines[0] and "reward.correct_reward=1.0" in lines[0]
    assert not (folder / "m.db").exists() and not (folder / "out" / "checkpoints").exists()
