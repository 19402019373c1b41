"""A stored config runs no code through its interpolations or importable strings.

Owns: `check_stored_targets` on interpolations (``${oc.create:...}``, ``${oc.decode:...}`` of a crafted dict,
a ``_target_`` assembled from ``${...}`` pieces, a resolver outside the safe set, one that does not resolve),
on MathVerifyReward's ``check: "module:function"``, on the interpolations conf/ itself writes (pass), and a
resume from a checkpoint whose stored reward builds ``pathlib.Path.write_text`` through ``oc.create``
(refused with one line, the file is not written). Leaves out: plain ``_target_`` checks and crafted
pickles (test_untrusted_files.py).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from fspo.runtime.checkpoints.stored_config import UntrustedTarget, check_stored_targets

REWARD = "fspo.rewards.arithmetic.ArithmeticReward"
TRUSTED = OmegaConf.create({"reward": {"_target_": REWARD}})


@pytest.mark.parametrize("cfg, key", [
    ({"reward": {"_target_": REWARD, "format_reward":
                 "${oc.create:{_target_: pathlib.Path.write_text, _args_: [/tmp/x, y]}}"}}, "reward.format_reward"),
    ({"reward": {"_target_": REWARD, "format_reward": "${oc.decode:'{_target_: shutil.copyfile}'}"}},
     "reward.format_reward._target_=shutil.copyfile"),
    ({"a": "os", "reward": {"_target_": "${a}.system"}}, "reward._target_=os.system"),
    ({"reward": "${oc.create:{_target_: builtins.open}}"}, "reward="),
    ({"reward": {"_target_": REWARD, "x": "${oc.env:NOPE_UNSET,${oc.create:{_target_: os.system}}}"}}, "oc.create"),
    ({"reward": {"_target_": REWARD, "x": "${missing.key}"}}, "does not resolve"),
    ({"reward": {"_target_": "fspo.rewards.math_verify_reward.MathVerifyReward", "check": "os:system"}},
     "reward.check=os:system"),
    ({"reward": {"_target_": "fspo.rewards.math_verify_reward.MathVerifyReward",
                 "check": "fspo.runtime.checkpoints.integrity:os"}}, "reward.check="),
])
def test_interpolations_and_importable_strings_are_checked(cfg, key):
    with pytest.raises(UntrustedTarget) as e:
        check_stored_targets(OmegaConf.create(cfg), "run_config.yaml", TRUSTED)
    msg = str(e.value)
    assert key in msg and "run_config.yaml" in msg and "refused" in msg and "\n" not in msg, msg


def test_the_interpolations_conf_writes_pass(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    ok = OmegaConf.create({
        "val": {"size": 4}, "data": {"data_dir": "${oc.env:FSPO_DATA_DIR,../shared/data}",
                                     "val": {"limit": "${val.size}", "data_dir": "${..data_dir}"}},
        "trainer": {"_target_": "lightning.Trainer", "devices": "${oc.decode:${oc.env:LOCAL_WORLD_SIZE,auto}}"},
        "reward": {"_target_": "fspo.rewards.math_verify_reward.MathVerifyReward",
                   "check": "fspo.rewards.verify_pool:math_verify_equal"}})
    check_stored_targets(ok, "run_config.yaml", TRUSTED)
    check_stored_targets(ok, "run_config.yaml", TRUSTED, keys=("data",))  # resolved against the whole config
    user = OmegaConf.create({"reward": {"_target_": REWARD, "check": "mypkg.checks:eq"}})
    check_stored_targets(user, "x", OmegaConf.create({"reward": {"check": "mypkg.checks:eq"}}))  # the user's own


def test_resume_from_a_checkpoint_whose_reward_writes_a_file_is_refused(compose_cfg, tmp_path):
    from conftest import SMALL
    from fspo.runtime.checks.errors import user_error
    from fspo.train import train

    cfg = compose_cfg(SMALL + ["steps=1", "val.size=0", "checkpoint.every_n_steps=1"])
    train(cfg)
    ckpt = sorted((Path(cfg.output_dir) / "checkpoints").glob("step_*.ckpt"))[-1]
    c = torch.load(ckpt, weights_only=True)
    saved = OmegaConf.create(c["fspo_resume"]["run_config"])
    marker = tmp_path / "written.pth"
    saved.reward.format_reward = ("${oc.create:{_target_: pathlib.Path.write_text, _args_: [{_target_: "
                                  f"pathlib.Path, _args_: [{marker}]}}, pwned]}}}}")
    c["fspo_resume"]["run_config"] = OmegaConf.to_yaml(saved)
    crafted = tmp_path / "crafted.ckpt"
    torch.save(c, crafted)
    with pytest.raises(ValueError) as e:
        train(compose_cfg(SMALL + ["steps=2", "val.size=0", f"resume={crafted}"]), overrides=[f"resume={crafted}"])
    msg = user_error(e.value)
    assert msg is not None and "reward.format_reward" in msg and "oc.create" in msg, msg
    assert not marker.exists()
