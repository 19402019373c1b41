"""Loading checkpoint files without running code from them.

A ``torch.save`` file is loaded with ``weights_only=True``; a torch.distributed.checkpoint folder's
``.metadata`` by an unpickler that allows only `METADATA_GLOBALS`. A file holding anything else (a pickled
object whose ``__reduce__`` would call a function, an ``nn.Module``) is refused with one line naming the file
and what it holds; nothing in it is called. fspo's checkpoints hold only tensors and plain values.
"""
from __future__ import annotations

import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch

# (module, name) pairs a torch.distributed.checkpoint ``.metadata`` pickle may name: the metadata
# dataclasses, the tensor descriptions they hold (dtype, layout, memory format, size) and paths
_DCP_META = "torch.distributed.checkpoint.metadata"
METADATA_GLOBALS = {
    (_DCP_META, n) for n in ("Metadata", "StorageMeta", "MetadataIndex", "TensorProperties", "ChunkStorageMetadata",
                             "TensorStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"), ("torch", "device"),
    ("torch._utils", "_get_layout"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
    ("builtins", "set"), ("builtins", "frozenset"),
}


class UnsafeCheckpoint(ValueError):
    """A checkpoint file that holds something other than tensors and plain values (never unpickled)."""


def _refusal(path, what: str) -> UnsafeCheckpoint:
    return UnsafeCheckpoint(f"refused to load {path}: it holds {what}, which could run code when unpickled; fspo's "
                            f"checkpoints hold only tensors and plain values -- load only checkpoints written by "
                            f"a training run you trust")


def safe_torch_load(path, mmap: bool = True) -> Any:
    """``torch.load(path, weights_only=True)`` on the CPU; `UnsafeCheckpoint` for a file holding other objects,
    ValueError for a legacy or non-torch file."""
    p = Path(path)
    if p.is_file() and not zipfile.is_zipfile(p):
        raise ValueError(f"{p} is not a torch zip checkpoint (a legacy pre-1.6 torch file or another format): "
                         f"fspo reads only files written by torch.save of torch >= 1.6; re-save it with a current "
                         f"torch (torch.save(torch.load(f, weights_only=True), f)) if you trust it")
    try:
        return torch.load(p, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:  # weights_only refused a global: report what, never retry unsafely
        raise _refusal(p, f"Python objects ({_global_of(e)})") from None
    except (RuntimeError, EOFError, KeyError, AttributeError, TypeError) as e:  # a zip that is no torch file
        raise ValueError(f"{p} is not a readable torch checkpoint ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:160] if str(e) else 'damaged'}): pass a step_N.ckpt written by "
                         f"a training run") from None


def _global_of(e: Exception) -> str:
    """The line of a weights_only refusal that names the global, e.g. 'Unsupported global: GLOBAL posix.system'."""
    line = next((ln.strip() for ln in str(e).splitlines() if "GLOBAL" in ln), "")
    return line[:160] or type(e).__name__


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in METADATA_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                   (torch.dtype, torch.layout,
                                                                                    torch.memory_format))):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name}")


def read_dcp_metadata(path):
    """The ``.metadata`` of a torch.distributed.checkpoint folder, unpickled with `METADATA_GLOBALS` only."""
    f = Path(path) / ".metadata"
    try:
        with open(f, "rb") as fh:
            return _MetadataUnpickler(fh).load()
    except pickle.UnpicklingError as e:
        raise _refusal(f, f"the global {e} (not checkpoint metadata)") from None
    except (EOFError, ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"{f} is not readable checkpoint metadata ({type(e).__name__}: {e})") from None


def safe_dcp_reader(path):
    """A ``FileSystemReader`` of ``path`` whose ``.metadata`` is the one `read_dcp_metadata` checked."""
    from torch.distributed.checkpoint import FileSystemReader

    checked = read_dcp_metadata(Path(path))

    class Reader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            meta = checked
            if getattr(meta, "storage_meta", None) is None:
                from torch.distributed.checkpoint.metadata import StorageMeta
                meta.storage_meta = StorageMeta()
            meta.storage_meta.load_id = self.load_id
            return meta

    return Reader(str(path))

