"""Exporting a LoRA checkpoint as a plain Hugging Face model, adapters merged into the base.

Owns: `export_merged(checkpoint, out_dir)` (experiments/export_lora.py is its command line). The
checkpoint holds the adapters; the base is rebuilt from the run's ``model`` config (saved in the
checkpoint as ``run_config``, checkpointing.py), the adapters loaded, merged
(W = W0 + (alpha / r) B A, peft's ``merge_and_unload``) and the result written with ``save_pretrained``
together with the tokenizer: a folder that ``AutoModelForCausalLM.from_pretrained``, vLLM and
``+model=... model.source=pretrained model.path=<out_dir>`` load as any other model. Leaves out:
training and evaluating (experiments/evaluate.py takes LoRA checkpoints directly).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from omegaconf import DictConfig, OmegaConf

from fspo.models.loading import load_policy
from fspo.models.lora import lora_settings
from fspo.runtime.checkpoints.files import find_checkpoints, load_checkpoint, load_into, read_resume_meta
from fspo.runtime.checkpoints.stored_config import check_stored_targets


def export_merged(checkpoint, out_dir, model_path: Optional[str] = None) -> Path:
    """Write the merged model of LoRA ``checkpoint`` (a ``.ckpt`` file, or a run folder: its newest
    checkpoint) to ``out_dir``; returns ``out_dir``. ``model_path`` overrides the run's ``model.path``
    (the base weights moved). Raises ValueError (one line) for a checkpoint of a run without LoRA."""
    ckpts = find_checkpoints(checkpoint)
    path = sorted(ckpts, key=lambda p: p.name)[-1]
    run_config = read_resume_meta(path).get("run_config")
    if not run_config:
        raise ValueError(f"{path} holds no run config to rebuild the base model from (written before run configs "
                         f"were saved): evaluate it with experiments/evaluate.py and model.* instead")
    try:
        run_cfg = OmegaConf.create(run_config)
        if not isinstance(run_cfg, DictConfig) or not isinstance(run_cfg.get("model"), DictConfig):
            raise ValueError("no model settings")
    except Exception as e:  # noqa: BLE001 - a damaged or crafted run config: one line
        raise ValueError(f"{path}: its stored run config is not readable ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:160]}): export a checkpoint written by a training run") from None
    check_stored_targets(run_cfg, f"checkpoint {path.name}", keys=("model",))  # its interpolations run nothing
    model_cfg = OmegaConf.to_container(run_cfg.model, resolve=True)
    if not lora_settings(model_cfg).enabled:
        raise ValueError(f"{path} is a full fine-tuning checkpoint (model.lora.rank=0), not a LoRA one: its policy "
                         f"weights are the whole model already (experiments/evaluate.py loads it as is)")
    if model_path is not None:
        model_cfg["path"] = model_path
    # the run's seed: with model.source=random it rebuilds the same base weights
    policy, tokenizer = load_policy(**model_cfg, seed=int(run_cfg.get("seed", 0)))
    state, _ = load_checkpoint(path)
    load_into(policy, state)
    merged = policy.merge_and_unload()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
