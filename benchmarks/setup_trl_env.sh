#!/usr/bin/env bash
# Build the separate benchmark environment .venv-trl for benchmarks/bench_trl.py (fspo vs TRL).
#
# Owns: `.venv-trl` = torch 2.13.0 (+cpu) + this project (editable, with [dev]) + trl (pinned).
# TRL is NOT a dependency of fspo: it lives only here. transformers is pinned to the version the
# main .venv has (when it exists) so both sides of the comparison run the same model code.
#
# Idempotent: when .venv-trl already imports the pinned trl, fspo from this checkout and a +cpu
# torch, it exits at once. Exits non-zero with a message naming the step that failed.
# Usage (from anywhere):  bash benchmarks/setup_trl_env.sh
# Env: VENV (default .venv-trl), PYTHON (default python3), FORCE=1 rebuilds from scratch,
#      TRANSFORMERS_VERSION (default: the main .venv's, else whatever pyproject allows).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${VENV:-.venv-trl}"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="2.13.0"
TRL_VERSION="1.16.0"   # needs transformers>=4.56.2; tested with transformers 5.19.0
if [[ -z "${TRANSFORMERS_VERSION:-}" && -x .venv/bin/python ]]; then
  TRANSFORMERS_VERSION="$(.venv/bin/python -c 'from importlib.metadata import version; print(version("transformers"))' 2>/dev/null)"
fi
TAG="setup_trl_env.sh"
. "$ROOT/.ci/venv_common.sh"   # PY, pipi, die, venv_start

check() {
  "$PY" - "$ROOT" "$TRL_VERSION" "${TRANSFORMERS_VERSION:-}" <<'PYEOF' 2>/dev/null
import os, sys
root, want, want_tf = sys.argv[1], sys.argv[2], sys.argv[3]
import torch
assert torch.__version__.endswith("+cpu"), torch.__version__
from importlib.metadata import version
assert version("trl") == want, version("trl")
assert not want_tf or version("transformers") == want_tf, version("transformers")
from trl import GRPOConfig, GRPOTrainer  # noqa: F401
import fspo
assert os.path.realpath(fspo.__file__).startswith(os.path.realpath(root)), fspo.__file__
PYEOF
}

venv_start "torch $TORCH_VERSION +cpu, fspo editable, trl $TRL_VERSION${TRANSFORMERS_VERSION:+, transformers $TRANSFORMERS_VERSION}"
TF_PIN=()
[[ -n "${TRANSFORMERS_VERSION:-}" ]] && TF_PIN=("transformers==$TRANSFORMERS_VERSION")
pipi -e ".[dev]" "${TF_PIN[@]}" || die "pip install -e .[dev] ${TF_PIN[*]}"
# torch pinned again so the resolver cannot swap the +cpu build for a CUDA one
pipi "trl==$TRL_VERSION" "torch==$TORCH_VERSION" "${TF_PIN[@]}" || die "pip install trl==$TRL_VERSION"
check || { "$PY" - "$ROOT" <<'PYEOF'
import torch, trl, transformers, fspo
print("torch", torch.__version__, "trl", trl.__version__, "transformers", transformers.__version__, "fspo", fspo.__file__)
PYEOF
die "verify $VENV (torch +cpu, trl $TRL_VERSION, fspo from $ROOT)"; }
echo "setup_trl_env.sh: $VENV ready in $(( $(date +%s) - START )) s"
