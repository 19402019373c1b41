"""Reading checkpoints: where a run's checkpoints are, what they hold, and the policy weights in them."""
from __future__ import annotations

import glob
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
from lightning.fabric.utilities.load import _METADATA_FILENAME  # "meta.pt" (tests/test_lightning_internals.py)

from fspo.runtime.checkpoints.safe_load import safe_dcp_reader, safe_torch_load

CKPT_RE = re.compile(r"^step_(\d+)\.ckpt$")
META_KEY = "fspo_resume"
RUN_ID_FILE = "mlflow_run_id"  # <output_dir>/mlflow_run_id: the MLflow run of the training run
RUN_ID_KEY = "mlflow_run_id"  # the same run id in a checkpoint's resume metadata (META_KEY)


def checkpoint_dir(output_dir) -> Path:
    return Path(output_dir) / "checkpoints"


def list_checkpoints(dirpath) -> List[Path]:
    """Complete checkpoints ``step_N.ckpt`` (files or shard folders) in ``dirpath``, oldest first."""
    d = Path(dirpath)
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := CKPT_RE.match(p.name))] if d.is_dir() else []
    return [p for _, p in sorted(found)]


def read_resume_meta(path) -> Dict[str, Any]:
    """``checkpoint["fspo_resume"]`` of a checkpoint file or shard folder (its ``meta.pt``); raises if unreadable."""
    p = Path(path)
    f = p / _METADATA_FILENAME if p.is_dir() else p
    ckpt = safe_torch_load(f)  # a crafted or non-torch file: one line, nothing unpickled
    if not isinstance(ckpt, dict) or META_KEY not in ckpt:
        raise ValueError(f"{p} is not a checkpoint written by fspo.runtime.checkpoints.checkpointing (no {META_KEY!r})")
    return ckpt[META_KEY]


def _is_ckpt(p: Path) -> bool:
    return p.is_file() or (p.is_dir() and (p / ".metadata").exists())


def find_checkpoints(spec) -> List[Path]:
    """Checkpoint paths for ``spec``: a path or list of ``.ckpt`` files, distributed checkpoint folders, globs
    or run folders (searched recursively, leaving out ``damaged/``); resolved, duplicates dropped, in order."""
    items = [spec] if isinstance(spec, (str, Path)) else list(spec or [])
    found: List[Path] = []
    for item in items:
        s = str(Path(str(item)).expanduser())
        if any(c in s for c in "*?["):
            paths = [Path(x) for x in sorted(glob.glob(s, recursive=True))]
        elif _is_ckpt(Path(s)):
            paths = [Path(s)]
        elif Path(s).is_dir():
            paths = sorted(p for p in Path(s).rglob("*.ckpt") if _is_ckpt(p) and p.parent.name != "damaged")
        else:
            raise FileNotFoundError(f"no checkpoint at {s}: give a .ckpt file, a run folder or a glob")
        paths = [p.resolve() for p in paths if _is_ckpt(p)]
        if not paths:
            raise FileNotFoundError(f"no checkpoints (*.ckpt) found for {s}")
        found += paths
    return list(dict.fromkeys(found))


def find_run_config(path, levels: int = 5) -> Optional[Path]:
    """The first ``run_config.yaml`` (the run's own config, kept on resume), ``.hydra/config.yaml`` (each
    launch's) or ``config.yaml`` in ``path``'s folder or up to ``levels`` parents; None if none."""
    p = Path(path).resolve()
    start = p if p.is_dir() else p.parent
    for d in [start, *start.parents][:levels + 1]:
        for cand in (d / "run_config.yaml", d / ".hydra" / "config.yaml", d / "config.yaml"):
            if cand.is_file():
                return cand
    return None


def read_config_file(path):
    """A run's stored config file as a DictConfig; ValueError for a file that is not a YAML mapping."""
    from omegaconf import DictConfig, OmegaConf

    try:
        cfg = OmegaConf.load(path)
        if not isinstance(cfg, DictConfig):
            raise ValueError(f"a {type(cfg).__name__}, not a mapping of settings")
    except Exception as e:  # noqa: BLE001 - malformed YAML (yaml's errors are no ValueError): one line
        raise ValueError(f"{path} is not a readable run config ({type(e).__name__}: "
                         f"{' '.join(str(e).split())[:200]}): repair it or pass model.* and checkpoints=... "
                         f"instead") from None
    return cfg


def run_id_of_checkpoint(path, levels: int = 3) -> Optional[str]:
    """The MLflow run id that wrote a checkpoint: ``mlflow_run_id`` in its folder or up to ``levels`` parents,
    else the id in Lightning's MLFlowLogger layout ``.../<run id>/checkpoints/<file>``; None if neither."""
    p = Path(path).resolve()
    for d in list(p.parents)[:levels + 1]:
        f = d / RUN_ID_FILE
        if f.is_file() and re.fullmatch(r"[0-9a-f]{32}", f.read_text().strip()):
            return f.read_text().strip()
    rid = p.parent.parent.name
    return rid if p.parent.name == "checkpoints" and re.fullmatch(r"[0-9a-f]{32}", rid) else None


def _dcp_load(path: Path, prefix: str = "policy.") -> dict:
    """``{"state_dict": ...}`` plus ``meta.pt`` of a distributed checkpoint folder: only the tensors of
    ``state_dict.<prefix>*`` and ``state_dict.rl_step`` are read, never the optimizer's state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    head = "state_dict."
    reader = safe_dcp_reader(path)
    wanted = {k[len(head):]: m for k, m in reader.read_metadata().state_dict_metadata.items()
              if k.startswith(head + prefix) or k == head + "rl_step"}
    sd = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in wanted.items()
          if isinstance(m, TensorStorageMetadata)}
    if sd:
        dcp.load({"state_dict": sd}, storage_reader=reader)
    ckpt = {"state_dict": sd}
    meta = path / _METADATA_FILENAME  # Lightning's non-tensor state (loops, global_step)
    if meta.exists():
        ckpt = {**safe_torch_load(meta), **ckpt}
    return ckpt


def checkpoint_step(ckpt: dict, path: Optional[Path] = None) -> Optional[int]:
    """RLModule's ``rl_step``, else the fit loop's ``_batches_that_stepped``, else ``global_step``, else
    ``step=N`` in the file name; None if unknown."""
    sd = ckpt.get("state_dict") or {}
    if "rl_step" in sd:
        return int(sd["rl_step"])
    loop = ((ckpt.get("loops") or {}).get("fit_loop") or {}).get("epoch_loop.state_dict") or {}
    if "_batches_that_stepped" in loop:
        return int(loop["_batches_that_stepped"])
    if "global_step" in ckpt:
        return int(ckpt["global_step"])
    m = re.search(r"step=(\d+)", path.name) if path is not None else None
    return int(m.group(1)) if m else None


def load_checkpoint(path, prefix: str = "policy.") -> Tuple[Dict[str, torch.Tensor], Optional[int]]:
    """(policy state dict without ``prefix``, RL step) from a ``.ckpt`` file or distributed checkpoint folder."""
    p = Path(path)
    if p.is_dir():
        if not (p / ".metadata").exists():
            raise ValueError(f"{p} is a folder but not a distributed checkpoint (no .metadata)")
        ckpt = _dcp_load(p, prefix)
    elif p.is_file():
        ckpt = safe_torch_load(p)
    else:
        raise FileNotFoundError(f"checkpoint not found: {p}")
    sd = ckpt.get("state_dict") if isinstance(ckpt, dict) else None
    if not isinstance(sd, dict):
        raise ValueError(f"{p} has no 'state_dict': expected a Lightning checkpoint written by a training run")
    policy = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
    if not policy:
        raise ValueError(f"{p}: no '{prefix}*' entries in state_dict (keys start {sorted(sd)[:3]})")
    return policy, checkpoint_step(ckpt, p)


def load_into(policy, state: Dict[str, torch.Tensor]) -> None:
    """Copy ``state`` into ``policy`` (strict: every key must match; a clear error otherwise)."""
    from fspo.models.lora import is_lora

    missing, unexpected = policy.load_state_dict(state, strict=False)
    if is_lora(policy):  # a LoRA checkpoint holds the adapters; the frozen base was built from the model config
        missing = [k for k in missing if "lora_" in k]
    if missing or unexpected:
        raise ValueError(f"checkpoint does not fit the model built from the model config: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}: check model.* (or use_run_model=true)")
