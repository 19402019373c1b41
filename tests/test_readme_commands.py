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


MAIN = ("python experiments/run.py", "python experiments/run.py +method=grpo")


@pytest.fixture(scope="module")
def main_runs(tmp_path_factory):
    """{README command: (CompletedProcess, its folder)}: each of MAIN, shortened by SHORT, with a folder and store
    of its own (its working directory: the relative paths of the repo root, so stores stay there), run once per
    session as the script itself in one interpreter (conftest.run_py_cases)."""
    from conftest import run_py_cases

    cmds = [c for c in readme_commands() if c in MAIN]

    def cases(folder):
        out = {}
        for i, cmd in enumerate(cmds):
            argv = shlex.split(cmd)
            out[f"run{i}"] = ([*argv[2:], *SHORT, f"output_dir={folder / f'run{i}' / 'out'}"],
                              {"MLFLOW_TRACKING_URI": f"sqlite:///{folder / f'run{i}' / 'mlflow.db'}"}, REPO / argv[1])
        return out

    get = run_py_cases(tmp_path_factory, "readme_main_runs", cases, {**os.environ, "PYTHONWARNINGS": "ignore"})
    return {cmd: get(f"run{i}") for i, cmd in enumerate(cmds)}


@pytest.mark.slow
def test_main_job_and_method_override_run_as_written(main_runs):
    """``python experiments/run.py`` and ``... +method=grpo`` (README), two steps each: the block the README
    shows is printed, with the folder, checkpoints, store, held-out accuracy and the MLflow pages."""
    assert set(main_runs) == set(MAIN)
    for cmd, (proc, _, folder) in main_runs.items():
        assert proc.returncode == 0, proc.stderr[-3000:]
        log = proc.stdout + proc.stderr
        for key in ("output dir:", "checkpoints:", "tracking URI:", "held-out acc:", "open with:",
                    "experiment page:", "run page:"):
            assert key in log, (cmd, key, log[-2000:])
        assert (folder / "out" / "checkpoints" / "step_000002.ckpt").exists()
