"""Loading the policy and tokenizer named by the model config (`load_policy`), by ``model.source``:
``warmstart`` (the committed tiny warm start, or ``model.path``), ``random`` (a fresh tiny Qwen3, ``model.arch``
overriding its config) or ``pretrained`` (``model.path``, else the hub id ``model.hub_id``). A hub id is looked
up without retries: offline (``HF_HUB_OFFLINE``/``TRANSFORMERS_OFFLINE``) or when one 3 s probe of ``HF_ENDPOINT``
fails, only the local cache is read. ``meta=True`` (trainer=fsdp): a folder with safetensors is built on the
meta device, the sharding step filling each rank's shard (meta_init.py); other sources load in full.
"""
from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Optional
from urllib.parse import urlparse

import torch

ASSETS = Path(__file__).resolve().parent.parent / "assets"
WARMSTART_DIR = ASSETS / "tiny_warmstart"


class ModelNotFoundError(FileNotFoundError):
    """The configured model is neither a local folder nor reachable on the hub."""


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


PICKLE_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.pkl", "*.ckpt")


def refuse_pickle_weights(path: Path, key: str = "model.path") -> None:
    """ValueError for a model folder whose weights are pickles, which can run code when loaded: fspo loads
    safetensors only (and never a folder's own code)."""
    if any(Path(path).glob("*.safetensors")):
        return
    found = sorted(p.name for pat in PICKLE_WEIGHTS for p in Path(path).glob(pat))
    if found:
        raise ValueError(f"{key}={path} holds pickle weights ({', '.join(found[:3])}), which can run code when loaded; "
                         f"fspo loads safetensors only: convert them on a machine where you trust the files "
                         f"(AutoModelForCausalLM.from_pretrained(p).save_pretrained(p, safe_serialization=True))")


def _from_dir(path: Path, dtype: torch.dtype, meta: bool = False):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    refuse_pickle_weights(path)
    tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)  # never the folder's own code
    if meta and _has_safetensors(path):
        from fspo.models.meta_init import build_on_meta

        return build_on_meta(path, dtype), tok
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, use_safetensors=True, trust_remote_code=False)
    return model, tok


def download_command(hub_id: str, local_dir: str) -> str:
    """The installed huggingface_hub's download command: ``hf download`` (>= 1.0), else ``huggingface-cli``."""
    try:
        from importlib.metadata import version

        major = int(version("huggingface_hub").split(".")[0])
    except Exception:  # noqa: BLE001 - not installed or unparsable: the current CLI
        major = 1
    cli = "hf" if major >= 1 else "huggingface-cli"
    return f"{cli} download {hub_id} --local-dir {local_dir}"


def _offline_reason(timeout_s: float = 3.0) -> Optional[str]:
    """Why the hub must not be contacted (an offline variable, or a failed probe), or None."""
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            return f"{var}={os.environ[var]}"
    endpoint = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = endpoint.hostname or "huggingface.co", endpoint.port or (80 if endpoint.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
        return None
    except OSError as e:
        return f"{host}:{port} unreachable: {e}"


def _has_safetensors(path: Path) -> bool:
    return (path / "model.safetensors").exists() or (path / "model.safetensors.index.json").exists()


def _cached_snapshot(hub_id: str) -> Optional[Path]:
    """The local cache's folder of ``hub_id`` when it holds the config and safetensors weights, else None."""
    try:
        from huggingface_hub import snapshot_download

        p = Path(snapshot_download(hub_id, local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached (or no hub library): the full load below decides
        return None
    return p if (p / "config.json").exists() and _has_safetensors(p) else None


def _check_config_json(p: Path, key: str) -> None:
    """A folder's config.json must be a JSON object (a malformed one ends in one line, not a traceback)."""
    try:
        ok = isinstance(json.loads((p / "config.json").read_text()), dict)
        err = "" if ok else "not a JSON object"
    except (ValueError, UnicodeDecodeError) as e:
        ok, err = False, f"{type(e).__name__}: {e}"
    if not ok:
        raise ValueError(f"{key}={p}: its config.json is malformed ({err}): re-create the folder with "
                         f"save_pretrained / `{download_command('<hub id>', str(p))}`, or fix the file")


def local_model_config(model_cfg):
    """The model's transformers config from its settings alone: ``model.arch`` for a random model, else the local
    config.json (``model.path``, the warm start, or the hub cache); OSError / ValueError when it is not there."""
    source = model_cfg.get("source")
    if source == "random":
        from fspo.models.tiny import tiny_qwen3_config

        return tiny_qwen3_config(**dict(model_cfg.get("arch") or {}))
    from transformers import AutoConfig

    where = model_cfg.get("path") or (WARMSTART_DIR if source == "warmstart" else model_cfg.get("hub_id"))
    return AutoConfig.from_pretrained(str(where), local_files_only=True, trust_remote_code=False)


def enable_activation_checkpointing(model) -> None:
    """``model.activation_checkpointing``: HF gradient checkpointing, non-reentrant (frozen LoRA inputs work)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not getattr(base, "supports_gradient_checkpointing", False):
        raise ValueError(f"model.activation_checkpointing=true: {type(base).__name__} does not support it; "
                         f"set it false")
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def load_policy(source: str = "warmstart", path: str | None = None, hub_id: str | None = None,
                dtype: str = "float32", seed: int = 0, arch: dict | None = None, meta: bool = False,
                lora: dict | None = None, **_ignored):
    """(model, tokenizer) for the model config's fields; with ``model.lora`` the model wrapped with adapters
    (built in full, not on meta: the adapters have no weights on disk)."""
    from fspo.models.lora import apply_lora, lora_settings

    settings = lora_settings({"lora": lora})
    model, tok = _load(source, path, hub_id, dtype, seed, arch, meta and not settings.enabled)
    return apply_lora(model, settings), tok


def _load(source, path, hub_id, dtype, seed, arch, meta):
    if dtype not in DTYPES:
        raise ValueError(f"model.dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    torch_dtype = DTYPES[dtype]
    if source == "random":
        from fspo.models.tiny import build_tiny_model, build_tokenizer

        try:
            model = build_tiny_model(seed=seed, **(arch or {}))
        except (RuntimeError, ValueError, TypeError) as e:  # a malformed model.arch: one line, not a traceback
            raise ValueError(f"model.arch={dict(arch or {})} does not build a model ({type(e).__name__}: "
                             f"{str(e).splitlines()[0][:160]}): fix model.arch (sizes positive, hidden_size a "
                             f"multiple of num_attention_heads) or drop it for the tiny default") from None
        return model.to(torch_dtype), build_tokenizer()
    if source not in ("warmstart", "pretrained"):
        raise ValueError(f"model.source must be 'warmstart', 'random' or 'pretrained', got {source!r}")
    if source == "warmstart" or path:  # a local folder
        p = Path(path).expanduser() if path else WARMSTART_DIR
        if not (p / "config.json").exists():
            raise FileNotFoundError(
                f"warm-start checkpoint not found at {p}: run `python experiments/warmstart.py --out {p}` or set "
                f"model.source=random" if source == "warmstart" else f"model.path={p} has no config.json: point "
                f"model.path at a folder made by save_pretrained or `{download_command('<hub id>', str(p))}`")
        _check_config_json(p, "model.path")
        return _from_dir(p, torch_dtype, meta)
    if not hub_id:
        raise ValueError("model.source=pretrained needs model.path (a local folder) or model.hub_id")
    os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", "10")
    os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", "10")
    from huggingface_hub import constants
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if meta and (cached := _cached_snapshot(hub_id)) is not None:
        return _from_dir(cached, torch_dtype, meta)
    offline = _offline_reason()  # probe once: no hub retries when it cannot answer
    before = constants.HF_HUB_OFFLINE  # the library reads HF_HUB_OFFLINE at import: switch its constant
    constants.HF_HUB_OFFLINE = before or offline is not None
    try:
        tok = AutoTokenizer.from_pretrained(hub_id, local_files_only=offline is not None, trust_remote_code=False)
        model = AutoModelForCausalLM.from_pretrained(hub_id, dtype=torch_dtype, use_safetensors=True,
                                                     local_files_only=offline is not None, trust_remote_code=False)
    except (OSError, ValueError) as e:
        where = f"its local cache (offline: {offline})" if offline else "the Hugging Face hub or its local cache"
        raise ModelNotFoundError(
            f"could not load model '{hub_id}' from {where} ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:200]}). On a machine with internet run "
            f"`{download_command(hub_id, '/path/to/' + hub_id.split('/')[-1])}`, copy it here, "
            f"and pass model.path=/path/to/... "
            f"(or set HF_HOME to a cache that holds it).") from None
    finally:
        constants.HF_HUB_OFFLINE = before
    return model, tok
