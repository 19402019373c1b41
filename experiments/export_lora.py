"""Export a LoRA training checkpoint as a plain Hugging Face model folder (adapters merged).

    python experiments/export_lora.py <checkpoint .ckpt or run folder> <out_dir> [--model-path BASE]

The base is rebuilt from the run's saved model config (``--model-path`` if its weights moved); see
fspo/runtime/checkpoints/hf_export.py and docs/lora.md. Exit 2 with one line on bad input.
"""
from __future__ import annotations

import argparse
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("out_dir")
    ap.add_argument("--model-path", default=None, help="local folder of the base weights (overrides model.path)")
    a = ap.parse_args()
    from fspo.runtime.checkpoints.hf_export import export_hf
    from fspo.runtime.checks.errors import user_error

    try:
        out = export_hf(a.checkpoint, a.out_dir, a.model_path, lora_only=True)
    except Exception as e:  # noqa: BLE001 - user errors become one line, bugs keep their traceback
        msg = user_error(e)
        if msg is None:
            raise
        print(f"error: {msg}", file=sys.stderr)
        return 2
    print(f"merged model written to {out} (load it with model.source=pretrained model.path={out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
