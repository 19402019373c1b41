"""The README's commands run as written, shortened where a full run would take minutes: the main
job and the one-override examples get ``steps=2 val.size=8`` (and a folder and store of the test's own), and
the end-of-run block the README shows is the one printed. The set-up commands are what .ci/run runs; the
MLflow UI command is opened in a browser by tests/test_mlflow_ui_browser.py; hub/local-weight lines
(``model.path=/data/...``) need weights this machine does not have and are checked for their keys only
(tests/test_cli_keys.py)."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.docs  # a check of the docs and layout (runs by default; -m docs selects them)

SHORT = ["steps=2", "val.size=8", "val.every_n_steps=2", "prompts_per_step=4", "rollout.sampling.n=2",
         "ppo.mini_batch_size=8", "ppo.mini_batch_unit=sequences", "rollout.sampling.max_new_tokens=48"]


def readme_commands() -> list[str]:
    """Every ``python experiments/...`` line of the README's bash blocks, comments stripped."""
    text = (REPO / "README.md").read_text()
    lines = [ln.split("  #")[0].strip() for block in re.findall(r"```bash\n(.*?)```", text, re.S)
             for ln in block.splitlines()]
    return [ln for ln in lines if ln.startswith("python experiments/")]


def test_the_readme_names_the_main_job_and_its_overrides():
    cmds = readme_commands()
    assert "python experiments/run.py" in cmds and "python experiments/run.py +method=grpo" in cmds


def _run(cmd: str, tmp_path, name: str) -> str:
    argv = shlex.split(cmd)  # run from a scratch folder (the relative paths of the repo root), so stores stay there
    out = tmp_path / name
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, str(REPO / argv[1]), *argv[2:], *SHORT, f"output_dir={out}"], cwd=tmp_path,
                          env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


@pytest.mark.slow
def test_main_job_and_method_override_run_as_written(tmp_path):
    """``python experiments/run.py`` and ``... +method=grpo`` (README), two steps each: the block the README
    shows is printed, with the folder, checkpoints, store, held-out accuracy and the MLflow pages."""
    for i, cmd in enumerate(c for c in readme_commands() if c in ("python experiments/run.py",
                                                                  "python experiments/run.py +method=grpo")):
        log = _run(cmd, tmp_path, f"run{i}")
        for key in ("output dir:", "checkpoints:", "tracking URI:", "held-out acc:", "open with:",
                    "experiment page:", "run page:"):
            assert key in log, (cmd, key, log[-2000:])
        assert (tmp_path / f"run{i}" / "checkpoints" / "step_000002.ckpt").exists()
