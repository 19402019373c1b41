"""Files from elsewhere never run code: crafted checkpoints and stored configs.

Owns: a ``torch.save`` file whose pickle calls a function when loaded (refused, nothing runs, one line
naming the file), a legacy (non-zip) torch file (one line), a distributed-checkpoint folder with a
crafted ``.metadata`` or a crafted byte item (refused) next to a clean one (loads), evaluate.py on a
crafted checkpoint (exit 2, one ``error:`` line, nothing ran), and a stored run config whose
``_target_`` names a function outside the allow-list (refused on resume before anything is built).
Leaves out: checksums of checkpoints (test_run_safety.py) and resuming itself (test_resume.py).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO
from fspo.runtime.checkpoints.files import load_checkpoint
from fspo.runtime.checkpoints.safe_load import UnsafeCheckpoint


class Payload:
    """Unpickling it runs ``touch <marker>``: what an attacker's checkpoint would do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def crafted_ckpt(tmp: Path) -> tuple[Path, Path]:
    marker, f = tmp / "pwned", tmp / "evil.ckpt"
    torch.save({"state_dict": {"policy.w": torch.ones(2)}, "global_step": 1, "x": Payload(marker)}, f)
    return f, marker


def test_crafted_checkpoint_is_refused_and_runs_nothing(tmp_path):
    f, marker = crafted_ckpt(tmp_path)
    with pytest.raises(UnsafeCheckpoint, match=f"refused to load {f}.*could run code"):
        load_checkpoint(f)
    assert not marker.exists()


def test_legacy_pickle_checkpoint_gets_one_line(tmp_path):
    f = tmp_path / "legacy.ckpt"
    torch.save({"state_dict": {"policy.w": torch.ones(2)}}, f, _use_new_zipfile_serialization=False)
    with pytest.raises(ValueError, match="not a torch zip checkpoint.*legacy") as e:
        load_checkpoint(f)
    assert "\n" not in str(e.value)


def test_clean_distributed_checkpoint_loads_and_crafted_ones_are_refused(tmp_path):
    import pickle

    import torch.distributed.checkpoint as dcp

    sd = {"state_dict": {"policy.w": torch.arange(4.0), "rl_step": torch.tensor(3)}, "loops": {"a": 1}}
    good = tmp_path / "good"
    dcp.save(sd, checkpoint_id=str(good), no_dist=True)
    policy, step = load_checkpoint(good)
    assert torch.equal(policy["w"], torch.arange(4.0)) and step == 3

    marker = tmp_path / "pwned"
    meta = tmp_path / "meta"
    dcp.save(sd, checkpoint_id=str(meta), no_dist=True)
    (meta / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(UnsafeCheckpoint, match=r"\.metadata.*posix\.system|\.metadata.*os\.system"):
        load_checkpoint(meta)
    item = tmp_path / "item"  # a crafted byte item is never unpickled: only the policy's tensors are read
    dcp.save({**sd, "extra": Payload(marker), "state_dict": {**sd["state_dict"], "policy.x": Payload(marker)}},
             checkpoint_id=str(item), no_dist=True)
    policy, step = load_checkpoint(item)
    assert set(policy) == {"w"} and step == 3
    assert not marker.exists()


@pytest.mark.slow  # > 2.5 s: out of the quick loop (-m "not slow"), still in CI
def test_evaluate_on_a_crafted_checkpoint_exits_2_and_runs_nothing(tmp_path):
    f, marker = crafted_ckpt(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"), PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, str(REPO / "experiments" / "evaluate.py"), f"checkpoints={f}",
                        "eval_data=[arithmetic]", "limit=2", "k=1", "model.source=random", "use_run_model=false",
                        f"output_dir={tmp_path / 'out'}", f"mlflow.tracking_uri=sqlite:///{tmp_path}/m.db",
                        f"hydra.run.dir={tmp_path / 'h'}"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 2, p.stderr[-3000:]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    lines = [x for x in p.stderr.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and str(f) in lines[0] and "refused" in lines[0], p.stderr[-3000:]
    assert not marker.exists()


# ------------------------------------------------------------------ stored configs
def test_stored_config_target_outside_the_allow_list_is_refused(tmp_path):
    from omegaconf import OmegaConf

    from fspo.runtime.checkpoints.stored_config import UntrustedTarget, check_stored_targets

    trusted = OmegaConf.create({"reward": {"_target_": "fspo.rewards.arithmetic.ArithmeticReward"}})
    ok = OmegaConf.create({"reward": {"_target_": "fspo.rewards.arithmetic.ArithmeticReward"},
                           "trainer": {"_target_": "lightning.Trainer"},
                           "logger": {"_target_": "lightning.pytorch.loggers.MLFlowLogger"}})
    check_stored_targets(ok, "run_config.yaml", trusted)
    for bad in ("torch.load", "os.system", "fspo.runtime.checkpoints.integrity.os.system", "builtins.eval",
                "fspo.runtime.checkpoints.safe_load.torch.load"):
        cfg = OmegaConf.create({"data": {"train": {"_target_": bad, "x": 1}}})
        with pytest.raises(UntrustedTarget, match=f"data.train._target_={bad}.*run_config.yaml") as e:
            check_stored_targets(cfg, "run_config.yaml", trusted)
        assert "\n" not in str(e.value)
    user = OmegaConf.create({"reward": {"_target_": "test_resume.DigitReward"}})  # named by this launch too
    check_stored_targets(user, "x", OmegaConf.create({"reward": {"_target_": "test_resume.DigitReward"}}))
    with pytest.raises(UntrustedTarget):
        check_stored_targets(user, "x", trusted)


def test_resume_from_a_crafted_config_is_refused_before_anything_runs(compose_cfg, tmp_path):
    """A checkpoint whose stored config names ``os.system``: resume=<path> stops with one line."""
    from omegaconf import OmegaConf

    from conftest import SMALL
    from fspo.runtime.checks.errors import user_error
    from fspo.train import train

    cfg = compose_cfg(SMALL + ["steps=1", "val.size=0", "checkpoint.every_n_steps=1"])
    train(cfg)
    ckpt = sorted((Path(cfg.output_dir) / "checkpoints").glob("step_*.ckpt"))[-1]
    c = torch.load(ckpt, weights_only=True)
    saved = OmegaConf.create(c["fspo_resume"]["run_config"])
    marker = tmp_path / "pwned"
    saved.reward = {"_target_": "os.system", "_args_": [f"touch {marker}"]}
    c["fspo_resume"]["run_config"] = OmegaConf.to_yaml(saved)
    crafted = tmp_path / "crafted.ckpt"
    torch.save(c, crafted)
    cfg2 = compose_cfg(SMALL + ["steps=2", "val.size=0", f"resume={crafted}"])
    with pytest.raises(ValueError) as e:
        train(cfg2)
    msg = user_error(e.value)
    assert msg is not None and "reward._target_=os.system" in msg and "allow" in msg, msg
    assert not marker.exists()
