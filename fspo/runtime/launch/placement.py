"""Where a run trains and generates: a model meant for GPUs (``model.device: cuda``) is placed on the GPUs the
machine has, each choice skipped when the command line names its key or group (an explicit setting wins):

  trainer.accelerator  cpu -> gpu
  several processes    trainer=fsdp's block (FSDP2, bf16 compute, float32 masters and gradient reduction)
  one process          trainer.devices=1, ppo.autocast=bf16 (unless model.dtype is already bf16)
  old log-probs        rollout.old_log_probs=recompute (bf16 compute: the trainer's own pass)
  rollout              vllm when it is installed, else HF generation under rollout.engine.autocast=bf16

With no GPU visible the run stops with one line (``trainer.accelerator=cpu`` trains on the CPU anyway);
``dry_run=true`` is placed as on one GPU per process. A ``model.device: cpu`` model stays on the CPU.
"""
from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

from omegaconf import OmegaConf, open_dict

log = logging.getLogger(__name__)
CONF = Path(__file__).resolve().parents[3] / "conf"
FSDP = "fspo.runtime.launch.distributed.FSDP2Strategy"


class PlacementError(ValueError):
    """The run needs a device this machine does not have."""


@dataclass(frozen=True)
class Machine:
    cuda: bool        # torch.cuda.is_available()
    gpus: int         # torch.cuda.device_count()
    world: int        # processes the launcher started (WORLD_SIZE, SLURM_NTASKS); 1 without one
    vllm: bool        # vllm importable

    @staticmethod
    def detect(env=os.environ) -> "Machine":
        import torch

        cuda = torch.cuda.is_available()
        world = next((int(env[k]) for k in ("WORLD_SIZE", "SLURM_NTASKS") if str(env.get(k, "")).isdigit()), 1)
        return Machine(cuda=cuda, gpus=torch.cuda.device_count() if cuda else 0, world=world,
                       vllm=importlib.util.find_spec("vllm") is not None)


def named_keys(overrides: Sequence[str]) -> set:
    """What a command line sets: each key with its parents (``trainer.accelerator=cpu`` -> trainer.accelerator,
    trainer) and each group it selects as ``group:<name>`` (``trainer=fsdp``, ``+rollout=vllm``)."""
    out = set()
    for o in overrides or ():
        key = o.split("=", 1)[0].lstrip("+~").strip()
        parts = key.split(".")
        out.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
        if len(parts) == 1:
            out.add(f"group:{key}")
    return out


PLACEMENT_GROUPS = ("trainer", "rollout")  # selecting one of these names every key in it


def _named(names: set, key: str) -> bool:
    """``key`` or its trainer/rollout group is set on the command line (``trainer=cpu`` names trainer.*)."""
    top = key.split(".")[0]
    return key in names or (top in PLACEMENT_GROUPS and f"group:{top}" in names and key != top)


def _set(cfg, key: str, value, names: set, choices: List[str], why: str) -> None:
    if _named(names, key) or OmegaConf.select(cfg, key) == value:
        return
    with open_dict(cfg):
        OmegaConf.update(cfg, key, value, merge=False, force_add=True)
    choices.append(f"{key}={value} ({why})")


def _group_block(group: str, option: str):
    block = OmegaConf.load(CONF / group / f"{option}.yaml")
    with open_dict(block):
        block.pop("defaults", None)
    return block


def place(cfg, overrides: Optional[Sequence[str]] = None, machine: Optional[Machine] = None) -> List[str]:
    """Place the run of ``cfg`` on ``machine``, in place, leaving what ``overrides`` name; returns the choices
    (logged). Raises `PlacementError` for a GPU model with no GPU visible."""
    m = machine or Machine.detect()
    names = named_keys(overrides or ())
    accel = str(OmegaConf.select(cfg, "trainer.accelerator", default="cpu"))
    device = str(OmegaConf.select(cfg, "model.device", default="cpu"))
    if device not in ("cpu", "cuda"):
        raise PlacementError(f"model.device={device}: must be cpu (placed as trainer/ says) or cuda (on the GPUs "
                             f"found), e.g. model.device=cuda")
    if device != "cuda":
        if m.cuda and accel == "cpu" and not _named(names, "trainer.accelerator"):
            log.warning("a CUDA GPU is visible but this run trains on the CPU (model %s has model.device=cpu); "
                        "set trainer.accelerator=gpu to use it", OmegaConf.select(cfg, "model.name"))
        return []
    choices: List[str] = []
    if OmegaConf.select(cfg, "dry_run") and not m.cuda:  # plan the GPU run (memory_plan.device_gib) as placed there
        m = Machine(cuda=True, gpus=1, world=m.world, vllm=m.vllm)
    if accel == "cpu" and _named(names, "trainer.accelerator"):
        return []  # asked for the CPU
    if not m.cuda:
        raise PlacementError(
            f"model {OmegaConf.select(cfg, 'model.name')} trains on CUDA GPUs and none is visible here "
            f"(torch.cuda.is_available() is False): run it on a GPU machine with its weights (model.path=<local "
            f"copy> or the hub; several GPUs: torchrun --nproc_per_node=N experiments/run.py ...), plan it with "
            f"dry_run=true memory_plan.device_gib=80, or add trainer.accelerator=cpu to train on the CPU anyway")
    if accel == "cpu":
        _set(cfg, "trainer.accelerator", "gpu", names, choices, f"{m.gpus} CUDA GPU(s) visible")
    if m.gpus > m.world and not OmegaConf.select(cfg, "dry_run"):  # one GPU per process: say what stays idle
        log.warning("%d CUDA GPUs are visible and %d process(es) were launched, one GPU each: %d stay unused; "
                    "launch one process per GPU to use them (torchrun --nproc_per_node=%d experiments/run.py ...)",
                    m.gpus, m.world, m.gpus - m.world, m.gpus)
    sharded = str(OmegaConf.select(cfg, "trainer.strategy._target_", default="") or "") == FSDP
    if m.world > 1 and not sharded and not _named(names, "trainer.strategy"):
        with open_dict(cfg):
            cfg.trainer = OmegaConf.merge(cfg.trainer, _group_block("trainer", "fsdp"))
            cfg.trainer.accelerator = "gpu"
        sharded = True
        choices.append(f"trainer=fsdp ({m.world} processes launched: FSDP2, bf16 compute, float32 masters)")
    if not sharded:
        _set(cfg, "trainer.devices", 1, names, choices, "one process: one GPU")
        if str(OmegaConf.select(cfg, "model.dtype", default="float32")) == "float32":  # a bf16 model computes in bf16
            _set(cfg, "ppo.autocast", "bf16", names, choices, "bf16 compute, float32 master weights")
    if not _named(names, "ppo.old_log_probs"):
        _set(cfg, "rollout.old_log_probs", "recompute", names, choices, "bf16 compute: the trainer's own pass")
    if str(OmegaConf.select(cfg, "rollout.name", default="hf")) == "hf" and not _named(names, "rollout.engine"):
        if m.vllm:
            with open_dict(cfg):
                cfg.rollout = OmegaConf.merge(cfg.rollout, _group_block("rollout", "vllm"))
            choices.append("rollout=vllm (vLLM is installed)")
        else:
            _set(cfg, "rollout.engine.autocast", "bf16", names, choices, "HF generation in bf16; vLLM is not installed")
    for c in choices:
        log.info("placement: %s", c)
    return choices
