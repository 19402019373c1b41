"""Unknown top-level config keys are refused before Hydra starts (fspo/cli.py `unknown_key_error`).

Hydra rejects ``stpes=5`` but its message advises ``+stpes=5``, which it then accepts silently: the
default 60-step run starts with the typo ignored. Both forms must exit at once, naming ``steps``.
"""
from __future__ import annotations

import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fspo.cli import CONF_DIR, known_top_keys, unknown_key_error

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("arg,fix", [("stpes=5", "steps=5"), ("+stpes=5", "steps=5"),
                                     ("ppo.lrr=1", "ppo.lr=1"), ("rollot.sampling.n=4", "rollout.sampling.n=4"),
                                     ("sede=3", "seed=3")])
def test_unknown_top_level_key_names_the_closest(arg, fix):
    msg = unknown_key_error([arg])
    if arg.startswith("ppo."):  # a nested typo: the closest key of the node it was meant for
        assert msg == "unknown config key 'ppo.lrr' in 'ppo.lrr=1': did you mean 'ppo.lr'? (ppo.lr=1)"
        return
    key = re.split(r"[=.]", arg.lstrip("+"))[0]
    assert msg == f"unknown config key '{key}' in '{arg}': did you mean '{fix.split('=')[0].split('.')[0]}'? ({fix})"


def test_known_keys_groups_flags_and_forced_adds_pass():
    argv = ["-m", "--config-dir", "sweeps", "--config-name", "fspo_c", "seed=1", "sweep.name=x", "+method=grpo",
            "model=tiny", "hydra.run.dir=/tmp/x", "++brand_new=1", "~tags", "--help", "+extra_loggers=[csv]",
            "clip.c_upper=0.1", "+experiment=paper_8xh200"]
    assert unknown_key_error(argv) is None
    assert unknown_key_error(["--config-dir", "sweeps", "--config-name", "fspo_c", "sweeep.name=x"]).startswith(
        "unknown config key 'sweeep'")


def test_known_keys_follow_the_primary_and_global_packages():
    keys = known_top_keys("config", [CONF_DIR])
    assert {"steps", "ppo", "rollout", "hydra", "method", "model", "clip", "experiment"} <= keys
    assert unknown_key_error(["limit=2", "eval_data=[arithmetic]"], "evaluate") is None
    assert "did you mean 'limit'" in unknown_key_error(["limt=2"], "evaluate")


def _readme_commands():
    """The run.py / evaluate.py commands of README.md and docs/*.md (the command reference lives there)."""
    text = "\n".join(p.read_text() for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))])
    for line in text.splitlines():
        m = re.match(r"\s*(?:srun )?python experiments/(run|evaluate)\.py(.*)", line)
        if m:
            args = shlex.split(m.group(2).split("#")[0].replace("\\", " "), posix=True)
            yield m.group(1), [a for a in args if "<" not in a]


@pytest.mark.docs
def test_every_readme_command_uses_known_keys():
    cmds = list(_readme_commands())
    assert len(cmds) >= 15
    for app, args in cmds:
        assert unknown_key_error(args, "config" if app == "run" else "evaluate") is None, (app, args)


@pytest.mark.parametrize("arg", ["stpes=5", "+stpes=5"])
def test_run_py_refuses_a_typo_in_seconds(arg):
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "experiments/run.py", arg], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "did you mean 'steps'? (steps=5)" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr
    assert time.monotonic() - t0 < 30


@pytest.mark.docs
def test_gitignore_covers_what_the_readme_commands_create():
    """Folders and files the README's commands write (default run, sweeps, reports, evaluate, resume) are ignored."""
    text = (REPO / "README.md").read_text() + "".join(p.read_text() for p in (REPO / "docs").glob("*.md"))
    # report.py's --out folders (experiments/results/... holds committed results on purpose)
    outs = {m.split("/")[0] for m in re.findall(r"report\.py[^\n]*?--out ([\w.-]+/?[\w.<>-]*)", text)} - {"experiments"}
    made = {"outputs/x", "multirun/x", "mlflow.db", "mlruns/x", "runs/a", *(f"{o}/x" for o in outs)}
    p = subprocess.run(["git", "check-ignore", "--no-index", *sorted(made)], cwd=REPO, capture_output=True, text=True)
    ignored = set(p.stdout.split())
    assert ignored == made, sorted(made - ignored)
