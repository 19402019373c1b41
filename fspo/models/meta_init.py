"""A policy built without its weights in memory, and its weights read shard by shard from safetensors.

`build_on_meta` puts every parameter on the meta device (buffers stay real); `load_local_shards` materialises
them and fills each with this rank's rows of the checkpoint through ``safe_open(...).get_slice``, one tensor
mapped at a time: no broadcast, no rank ever holds the full model. Shardings understood: a plain tensor and a
DTensor with one ``Shard(0)`` mesh dimension (``torch.chunk`` rows). Tied parameters load once.
"""
from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Dict

import torch
from safetensors import safe_open
from torch import nn


@contextmanager
def _parameters_on_meta():
    """Every parameter registered inside the block is moved to the meta device as it is registered."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            p = module._parameters[name]
            module._parameters[name] = type(p)(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def build_on_meta(path: Path, dtype: torch.dtype) -> nn.Module:
    """The ``AutoModelForCausalLM`` of folder ``path`` (its config.json) with parameters on meta."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(path), trust_remote_code=False)
    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model._fspo_weights_dir = str(path)  # where `load_local_shards` reads from
    return model


def is_on_meta(model: nn.Module) -> bool:
    """True when any parameter (or its local shard) is on the meta device."""
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if local.device.type == "meta":
            return True
    return False


def _weight_files(path: Path) -> Dict[str, Path]:
    """checkpoint key -> the .safetensors file holding it."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        return {k: path / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    single = path / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"{path} has no model.safetensors(.index.json): re-save the model with "
                                f"save_pretrained(..., safe_serialization=True) or drop trainer=fsdp's meta loading")
    with safe_open(str(single), "pt") as f:
        return {k: single for k in f.keys()}


def _rows(param) -> tuple[int, int]:
    """(first row, row count) of this rank's part of ``param`` along dim 0."""
    if not hasattr(param, "to_local"):
        return 0, param.shape[0] if param.dim() else 0
    from torch.distributed.tensor import Shard

    shards = [(i, p) for i, p in enumerate(param.placements) if isinstance(p, Shard)]
    if any(p.dim != 0 for _, p in shards) or len(shards) > 1:
        raise NotImplementedError(f"only one Shard(0) mesh dimension is supported, got {param.placements}")
    local = param.to_local()
    if not shards:
        return 0, param.shape[0]
    mesh_dim = shards[0][0]
    n, world = param.shape[0], param.device_mesh.size(mesh_dim)
    chunk = -(-n // world)
    start = min(n, param.device_mesh.get_local_rank(mesh_dim) * chunk)
    if local.shape[0] != min(chunk, n - start):
        raise RuntimeError(f"unexpected local shard shape {tuple(local.shape)} of {tuple(param.shape)}")
    return start, local.shape[0]


def _checkpoint_key(name: str, keys) -> str:
    for cand in (name, name.removeprefix("model."), f"model.{name}"):
        if cand in keys:
            return cand
    raise KeyError(f"parameter {name} is not in the checkpoint: the folder's weights do not match its config.json")


@torch.no_grad()
def load_local_shards(model: nn.Module, device: torch.device | str = "cpu", path: str | Path | None = None) -> int:
    """Materialise ``model``'s meta parameters on ``device`` and copy in this rank's rows of the checkpoint in
    ``path`` (default: `build_on_meta`'s folder); buffers keep their values. Returns the elements loaded."""
    path = Path(path or getattr(model, "_fspo_weights_dir", ""))
    if not str(path) or not path.is_dir():
        raise ValueError(f"no weights folder to load the meta-device model from (got {str(path)!r})")
    files = _weight_files(path)
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    owners: Dict[int, list] = {}  # to_empty makes a new parameter per owner: tied ones are tied again below
    for module in model.modules():
        for n, p in module._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((module, n))
    model.to_empty(device=device)
    for (first, n0), *rest in owners.values():
        for module, n in rest:
            module._parameters[n] = first._parameters[n0]
    for n, b in model.named_buffers():
        b.copy_(buffers[n])
    loaded = 0
    for name, param in model.named_parameters():  # tied parameters: once, under their first name
        local = param.to_local() if hasattr(param, "to_local") else param
        if local.numel() == 0:
            continue
        key = _checkpoint_key(name, files)
        start, rows = _rows(param)
        # one mapping per tensor: the file pages this rank touched leave its RSS with the handle
        with safe_open(str(files[key]), "pt") as f:
            part = f.get_slice(key)[start:start + rows] if param.dim() else f.get_tensor(key)
            local.copy_(part.to(local.dtype))
        loaded += local.numel()
        del part
    return loaded
