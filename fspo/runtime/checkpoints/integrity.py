"""Checkpoint integrity: a SHA-256 manifest beside every checkpoint, verified before a resume, damaged
checkpoints moved aside (never deleted), and a non-finite check of loaded parameters.

The manifest ``step_N.ckpt.sha256`` is in ``sha256sum -c`` format, lists every file of the checkpoint (one
line per shard file for a folder) and is committed before the checkpoint is renamed into place, so a complete
checkpoint always has its manifest.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Dict, Iterable, List, Optional

import torch

log = logging.getLogger(__name__)
SUFFIX = ".sha256"
DAMAGED = "damaged"
_CHUNK = 1 << 22


class CheckpointCorrupt(ValueError):
    """A checkpoint whose bytes do not match its manifest, or whose parameters are not finite."""


def manifest_path(ckpt) -> Path:
    """``step_N.ckpt.sha256`` beside ``step_N.ckpt``."""
    ckpt = Path(ckpt)
    return ckpt.with_name(ckpt.name + SUFFIX)


def sha256_file(path) -> str:
    """Hex SHA-256 of a file, read in 4 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _files(path: Path) -> List[Path]:
    return [path] if path.is_file() else sorted(q for q in path.rglob("*") if q.is_file())


def shard_digests(tmp, rank: int) -> Dict[str, str]:
    """``{relative path: sha256}`` of rank ``rank``'s own shard files in the shard folder ``tmp`` ({} for a file)."""
    tmp = Path(tmp)
    if not tmp.is_dir():
        return {}
    pat = re.compile(rf"^__{int(rank)}_\d+\.distcp$")
    return {q.relative_to(tmp).as_posix(): sha256_file(q) for q in _files(tmp) if pat.match(q.name)}


def write_manifest(tmp, final, known: Optional[Dict[str, str]] = None) -> Path:
    """Hash the checkpoint at ``tmp`` (``known`` digests taken as given) and commit ``<final>.sha256`` naming the
    files as they will be once ``tmp`` is renamed to ``final``. Returns the manifest path."""
    tmp, final = Path(tmp), Path(final)
    known = known or {}
    lines = []
    for q in _files(tmp):
        rel = q.relative_to(tmp).as_posix() if tmp.is_dir() else ""
        digest = known.get(rel) or sha256_file(q)
        lines.append(f"{digest}  {final.name}{'/' + rel if rel else ''}\n")
    out = manifest_path(final)
    part = out.with_name(out.name + ".partial")
    with open(part, "w") as f:
        f.writelines(lines)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, out)
    return out


def verify(ckpt) -> bool:
    """True: every file of ``ckpt`` matches its manifest; False: no manifest; else `CheckpointCorrupt`."""
    ckpt = Path(ckpt)
    man = manifest_path(ckpt)
    if not man.is_file():
        return False
    base = ckpt.parent
    listed = set()
    for n, line in enumerate(man.read_text().splitlines(), 1):
        if not line.strip():
            continue
        digest, _, name = line.partition("  ")
        if len(digest) != 64 or not (name == ckpt.name or name.startswith(ckpt.name + "/")):
            raise CheckpointCorrupt(f"{man}: line {n} is not '<sha256>  {ckpt.name}[/file]'")
        f = base / name
        listed.add(f)
        if not f.is_file():
            raise CheckpointCorrupt(f"{name} is missing")
        if sha256_file(f) != digest:
            raise CheckpointCorrupt(f"{name} does not match its SHA-256 in {man.name} (damaged on disk)")
    extra = [q for q in _files(ckpt) if q not in listed] if ckpt.is_dir() else []
    if extra or not listed:
        raise CheckpointCorrupt(f"{ckpt.name} holds files not in {man.name}: {[q.name for q in extra][:5]}" if extra
                                else f"{man} lists no file")
    return True


def quarantine(ckpt) -> Path:
    """Move ``ckpt`` and its manifest into ``<its folder>/damaged/`` (a free name); returns its new path."""
    ckpt = Path(ckpt)
    dest_dir = ckpt.parent / DAMAGED
    dest_dir.mkdir(exist_ok=True)
    dest, i = dest_dir / ckpt.name, 0
    while dest.exists() or manifest_path(dest).exists():
        i += 1
        dest = dest_dir / f"{ckpt.name}.{i}"
    man = manifest_path(ckpt)
    if man.exists():
        os.replace(man, manifest_path(dest))
    os.replace(ckpt, dest)
    return dest


def nonfinite_tensors(named: Iterable) -> List[str]:
    """Names of the floating-point tensors in ``named`` (local shards of DTensors) holding a NaN or an inf."""
    bad = []
    for name, t in named:
        if not torch.is_tensor(t) or not t.is_floating_point():
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        if local.numel() and not bool(torch.isfinite(local.detach()).all()):
            bad.append(name)
    return bad


def _fsync(path: Path) -> None:
    for q in [path] if path.is_file() else [q for q in path.rglob("*") if q.is_file()] + [path]:
        fd = os.open(q, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_commit(tmp, final) -> None:
    """fsync ``tmp`` (file or folder), rename it to ``final`` (replacing it) and fsync the parent folder."""
    tmp, final = Path(tmp), Path(final)
    _fsync(tmp)
    if final.is_dir() and tmp.is_dir():  # os.replace cannot replace a non-empty folder
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync(final.parent)


def gathered_shard_digests(trainer, tmp: Path) -> Dict[str, str]:
    """`shard_digests` of every rank, gathered over the trainer's ranks (rank 0 hashes the rest)."""
    from fspo.runtime.launch.distributed import gather_objects

    return {k: v for part in gather_objects(shard_digests(tmp, trainer.global_rank)) for k, v in part.items()}
