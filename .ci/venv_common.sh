# Shared by .ci/install_vllm_cpu.sh and benchmarks/setup_trl_env.sh (sourced, not run): the steps
# every side environment of this project takes. The caller sets VENV, PYTHON, TORCH_VERSION, TAG
# (its name in messages) and defines check() (exit 0 when $VENV is ready).
# Provides: PY, pipi (pip install minus this machine's index-folder noise), die, and venv_start,
# which honours FORCE=1, exits 0 when check passes, else creates $VENV with a pinned +cpu torch.

PY="$VENV/bin/python"
pipi() { "$PY" -m pip install --progress-bar off "$@" 2> >(grep -v "is ignored: it is neither" >&2); }

die() { echo "$TAG: FAILED at step: $1" >&2; echo "  fix the cause above, then re-run; FORCE=1 rebuilds $VENV from scratch" >&2; exit 1; }

venv_start() {  # args: what the environment holds, for the log line
  if [[ "${FORCE:-0}" == "1" && -d "$VENV" ]]; then rm -rf "$VENV"; fi
  if [[ -x "$PY" ]] && check; then
    echo "$TAG: $VENV is ready ($1); nothing to do"
    exit 0
  fi
  START=$(date +%s)
  echo "$TAG: building $VENV ($1); takes several minutes"
  if [[ ! -x "$PY" ]]; then
    "$PYTHON" -m venv "$VENV" || die "create venv with $PYTHON -m venv $VENV"
  fi
  pipi -q --upgrade pip || die "upgrade pip"
  pipi "torch==$TORCH_VERSION" || die "pip install torch==$TORCH_VERSION"
}
