"""Loading the policy and tokenizer named by the model config.

Owns: `load_policy`. Sources, by ``model.source``:
  - ``warmstart``: the committed supervised warm start of the tiny model (fspo/assets/tiny_warmstart,
    made by experiments/warmstart.py), or ``model.path`` if set;
  - ``random``: a freshly initialised Qwen3 with the project's tokenizer (no files): the tiny
    config, with any ``model.arch`` keys overriding it (conf/model/qwen3_100m.yaml: ~100M params);
  - ``pretrained``: ``model.path`` (a local folder) if set, else the hub id ``model.hub_id``.
Offline, a hub id with no local copy fails fast (hub timeouts capped at 10 s) with a message
saying how to point at local weights. Leaves out: sharding (the module's configure_model).
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

ASSETS = Path(__file__).resolve().parent.parent / "assets"
WARMSTART_DIR = ASSETS / "tiny_warmstart"


class ModelNotFoundError(FileNotFoundError):
    """The configured model is neither a local folder nor reachable on the hub."""


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"model.dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


def _from_dir(path: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    return model, tok


def load_policy(source: str = "warmstart", path: str | None = None, hub_id: str | None = None,
                dtype: str = "float32", seed: int = 0, arch: dict | None = None, **_ignored):
    """(model, tokenizer) for the given model config fields (see the module docstring)."""
    torch_dtype = _dtype(dtype)
    if source == "random":
        from fspo.models.tiny import build_tiny_model, build_tokenizer

        return build_tiny_model(seed=seed, **(arch or {})).to(torch_dtype), build_tokenizer()
    if source == "warmstart":
        p = Path(path) if path else WARMSTART_DIR
        if not (p / "config.json").exists():
            raise FileNotFoundError(
                f"warm-start checkpoint not found at {p}: run `python experiments/warmstart.py --out {p}` "
                f"or set model.source=random")
        return _from_dir(p, torch_dtype)
    if source != "pretrained":
        raise ValueError(f"model.source must be 'warmstart', 'random' or 'pretrained', got {source!r}")
    if path:
        p = Path(path).expanduser()
        if not (p / "config.json").exists():
            raise FileNotFoundError(f"model.path={p} has no config.json: point model.path at a folder made "
                                    f"by save_pretrained or `huggingface-cli download ... --local-dir`")
        return _from_dir(p, torch_dtype)
    if not hub_id:
        raise ValueError("model.source=pretrained needs model.path (a local folder) or model.hub_id")
    os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", "10")
    os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", "10")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(hub_id)
        model = AutoModelForCausalLM.from_pretrained(hub_id, dtype=torch_dtype)
    except (OSError, ValueError) as e:
        raise ModelNotFoundError(
            f"could not load model '{hub_id}' from the Hugging Face hub or its local cache ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:200]}). On a machine with internet run `huggingface-cli download {hub_id} "
            f"--local-dir /path/to/{hub_id.split('/')[-1]}`, copy it here, and pass model.path=/path/to/... "
            f"(or set HF_HOME to a cache that holds it).") from None
    return model, tok
