"""Exporting a LoRA checkpoint as a plain Hugging Face model, adapters merged into the base (`export_hf`)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from fspo.models.lora import lora_settings
from fspo.runtime.checkpoints.hf_export import export_hf, newest_checkpoint, run_model_config


def export_merged(checkpoint, out_dir, model_path: Optional[str] = None) -> Path:
    """`export_hf` of a LoRA ``checkpoint``; ValueError (one line) for a checkpoint of a run without LoRA."""
    path = newest_checkpoint(checkpoint)
    if not lora_settings(run_model_config(path)[1]).enabled:
        raise ValueError(f"{path} is a full fine-tuning checkpoint (model.lora.rank=0), not a LoRA one: its policy "
                         f"weights are the whole model already (experiments/evaluate.py loads it as is)")
    return export_hf(path, out_dir, model_path)
