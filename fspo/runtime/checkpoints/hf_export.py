"""Exporting any training checkpoint as a Hugging Face model folder (config, tokenizer, safetensors).

The checkpoint may be a ``.ckpt`` file, a sharded checkpoint folder (only the policy's tensors are read) or a
run folder (its newest). The model is rebuilt from the run config saved in the checkpoint, the weights loaded
(LoRA adapters merged: W = W0 + (alpha / r) B A) and written with ``save_pretrained``, so that
``AutoModelForCausalLM.from_pretrained``, vLLM and ``model.source=pretrained`` load it. The weights keep the
checkpoint's dtype unless ``dtype`` casts them.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Tuple

import torch
from omegaconf import DictConfig, OmegaConf

from fspo.models.loading import DTYPES, load_policy
from fspo.models.lora import is_lora, lora_settings
from fspo.runtime.checkpoints.files import find_checkpoints, load_checkpoint, load_into, read_resume_meta
from fspo.runtime.checkpoints.stored_config import check_stored_targets


def run_model_config(path: Path, model_path: Optional[str] = None) -> Tuple[DictConfig, dict]:
    """(the run config stored in checkpoint ``path``, its resolved ``model`` settings, ``model_path`` as the
    path); ValueError (one line) when there is none or it is unreadable; its interpolations run nothing."""
    run_config = read_resume_meta(path).get("run_config")
    if not run_config:
        raise ValueError(f"{path} holds no run config to rebuild the model from (written before run configs were "
                         f"saved): evaluate it with experiments/evaluate.py and model.* instead")
    try:
        run_cfg = OmegaConf.create(run_config)
        if not isinstance(run_cfg, DictConfig) or not isinstance(run_cfg.get("model"), DictConfig):
            raise ValueError("no model settings")
    except Exception as e:  # noqa: BLE001 - a damaged or crafted run config: one line
        raise ValueError(f"{path}: its stored run config is not readable ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:160]}): export a checkpoint written by a training run") from None
    check_stored_targets(run_cfg, f"checkpoint {path.name}", keys=("model",))
    model_cfg = OmegaConf.to_container(run_cfg.model, resolve=True)
    if model_path is not None:
        model_cfg["path"] = model_path
    return run_cfg, model_cfg


def export_hf(checkpoint, out_dir, model_path: Optional[str] = None, dtype: Optional[str] = None,
              lora_only: bool = False) -> Path:
    """Write the model of ``checkpoint`` to ``out_dir`` as a Hugging Face folder; returns ``out_dir``.
    ``model_path``: moved base weights; ``dtype`` casts; ``lora_only``: refuse a run without LoRA."""
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)} (or omitted: the checkpoint's own), "
                         f"got {dtype!r}")
    path = sorted(find_checkpoints(checkpoint), key=lambda p: p.name)[-1]  # itself, or a run folder's newest
    run_cfg, model_cfg = run_model_config(path, model_path)
    if lora_only and not lora_settings(model_cfg).enabled:
        raise ValueError(f"{path} is a full fine-tuning checkpoint (model.lora.rank=0), not a LoRA one: its policy "
                         f"weights are the whole model already (experiments/evaluate.py loads it as is)")
    model_cfg["meta"] = False
    state, _ = load_checkpoint(path)
    stored = next((v.dtype for v in state.values() if v.is_floating_point()), torch.float32)
    policy, tokenizer = load_policy(**model_cfg, seed=int(run_cfg.get("seed", 0)))  # source=random: the run's seed
    if not is_lora(policy):
        policy = policy.to(stored)  # the trainer's master weights, not model.dtype's copy
    load_into(policy, state)
    if is_lora(policy):
        policy = policy.merge_and_unload()
    if dtype is not None:
        policy = policy.to(DTYPES[dtype])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    policy.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def main(argv=None) -> int:
    """``fspo-export CHECKPOINT OUT_DIR [--model-path BASE] [--dtype D]``; exit 2 with one line on bad input."""
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="fspo-export",
                                 description="Export a training checkpoint (a .ckpt file, a sharded checkpoint folder "
                                             "or a run folder: its newest) as a Hugging Face model folder.")
    ap.add_argument("checkpoint")
    ap.add_argument("out_dir")
    ap.add_argument("--model-path", default=None, help="local folder of the base weights (overrides model.path)")
    ap.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                    help="cast the written weights (default: as stored)")
    a = ap.parse_args(argv)
    try:
        out = export_hf(a.checkpoint, a.out_dir, a.model_path, a.dtype)
    except (ValueError, FileNotFoundError) as e:  # bad input: one line; anything else keeps its traceback
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    print(f"model written to {out} (load it with AutoModelForCausalLM.from_pretrained({str(out)!r}) or "
          f"model.source=pretrained model.path={out})")
    return 0
