"""Command-line conventions: ``group=x`` and ``+group=x`` both select a config
group, the console scripts exist, ``python -m fspo.sweeps --help`` prints usage, and each Hydra app's
``--help`` lists only its own config groups.

Owns: `fspo.cli.normalize_group_overrides` on the root config, a sweep config whose defaults list
has ``method`` (sweeps/fspo_c.yaml) and an experiment that adds ``/model``; the real entry points
(``experiments/run.py ... --cfg job``) printing the same config for both forms; the console scripts
of pyproject.toml; the help texts.
"""
from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from conftest import CONF, REPO, compose_config, run_in_process
from fspo.cli import normalize_group_overrides

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

SWEEPS = REPO / "sweeps"
ENV = {**os.environ, "HYDRA_FULL_ERROR": "1", "OMP_NUM_THREADS": "1"}


def run(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=timeout)


def test_normalize_group_overrides():
    n = normalize_group_overrides
    assert n([]) == []
    assert n(["method=grpo", "model=qwen3_8b", "experiment=paper_qwen3_8b"]) == \
        ["+method=grpo", "model=qwen3_8b", "+experiment=paper_qwen3_8b"]  # the experiment adds /model
    assert n(["+method=grpo", "+model=qwen3_8b"]) == ["+method=grpo", "+model=qwen3_8b"]
    assert n(["+clip=grpo", "clip=fspo_ema"]) == ["clip=grpo", "clip=fspo_ema"]
    assert n(["--config-dir", str(SWEEPS), "arm=grpo_matched"])[-1] == "+arm=grpo_matched"
    # keys, flags, values and the other override forms pass as they are
    keep = ["model.path=/x", "ppo.lr=1e-6", "++seed=3", "~tags", "-m", "hydra.run.dir=a", "--cfg", "job", "method"]
    assert n(keep) == keep
    assert n(["-m", "method=fspo,grpo"]) == ["-m", "+method=fspo,grpo"]
    # a primary config with method in its defaults list (sweeps/fspo_c.yaml): the other way round
    assert n(["--config-dir", str(SWEEPS), "--config-name", "fspo_c", "+method=grpo"])[-1] == "method=grpo"
    assert n([f"--config-dir={SWEEPS}", "--config-name=methods", "method=grpo"])[-1] == "+method=grpo"
    assert n(["model=qwen3_8b", "eval_data=[math500]"], "evaluate") == ["+model=qwen3_8b", "eval_data=[math500]"]


@pytest.mark.parametrize("pair", [
    (["method=grpo"], ["+method=grpo"]),
    (["method=rloo", "model=qwen3_1_7b"], ["+method=rloo", "+model=qwen3_1_7b"]),
    (["experiment=paper_qwen3_8b", "method=gspo"], ["+experiment=paper_qwen3_8b", "+method=gspo"]),
    (["experiment=paper_qwen3_8b", "model=qwen3_1_7b"], ["+experiment=paper_qwen3_8b", "model=qwen3_1_7b"]),
])
def test_both_forms_compose_identically(pair):
    plain, plus = (compose_config(normalize_group_overrides(o)) for o in pair)
    assert OmegaConf.to_container(plain) == OmegaConf.to_container(plus)
    assert compose_config(normalize_group_overrides([])) == compose_config([])  # the default is untouched


def test_entry_point_accepts_both_forms():
    """experiments/run.py itself: `method=grpo` (Hydra alone refuses it) prints the `+method=grpo` config."""
    outs = [run("experiments/run.py", form, "--cfg", "job") for form in ("method=grpo", "+method=grpo")]
    for o in outs:
        assert o.returncode == 0, o.stderr[-2000:]
    assert outs[0].stdout == outs[1].stdout and "method: grpo" in outs[0].stdout.splitlines()
    assert "GRPOClip" in outs[0].stdout


def test_console_scripts():
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    scripts = meta["project"]["scripts"]
    assert set(scripts) == {"fspo-train", "fspo-eval", "fspo-report", "fspo-warmstart", "fspo-export-lora",
                            "fspo-export"}
    for target in scripts.values():
        mod, _, fn = target.partition(":")
        assert callable(getattr(importlib.import_module(mod), fn)), target
    exe = Path(sys.executable).parent / "fspo-report"
    if not exe.exists():
        pytest.skip("console scripts not installed in this environment (pip install -e .)")
    p = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=120, env=ENV)
    assert p.returncode == 0 and "--experiment" in p.stdout
    p = subprocess.run([str(exe.parent / "fspo-train"), "method=grpo", "--cfg", "job"], capture_output=True,
                       text=True, timeout=120, env=ENV, cwd=REPO)
    assert p.returncode == 0 and "method: grpo" in p.stdout.splitlines(), p.stderr[-2000:]


@pytest.mark.parametrize("fn, args, rc, text", [
    ("warmstart", ["--help"], 0, "usage: warmstart.py"),
    ("export_lora", ["/nonexistent.ckpt", "out"], 2, "error: FileNotFoundError: no checkpoint at /nonexistent.ckpt"),
    ("export", ["/nonexistent.ckpt", "out"], 2, "error: FileNotFoundError: no checkpoint at /nonexistent.ckpt"),
    ("export", ["--help"], 0, "usage: fspo-export"),
])
def test_console_script_functions_run_their_entry_point(fn, args, rc, text, tmp_path):
    """fspo-warmstart / fspo-export-lora / fspo-export (the functions pyproject names): their entry point with the same
    arguments, from any folder; the bad checkpoint ends with one line and exit code 2, as the script does. Called
    in this process as the console script calls it (test_console_scripts starts a real one)."""
    import fspo.cli

    p = run_in_process(getattr(fspo.cli, fn), [f"fspo-{fn}", *args], cwd=tmp_path)
    assert p.returncode == rc and text in p.stdout + p.stderr, p.stderr[-2000:]
    assert "Traceback" not in p.stderr


def test_sweeps_help():
    p = run("-m", "fspo.sweeps", "--help")
    assert p.returncode == 0 and p.stdout.startswith("usage: python -m fspo.sweeps") and "Traceback" not in p.stderr
    assert "methods" in p.stdout
    outs = [run("-m", "fspo.sweeps", "methods", form, "seed=1") for form in ("method=grpo", "+method=grpo")]
    assert outs[0].returncode == 0 and outs[0].stdout == outs[1].stdout, outs[0].stderr[-2000:]
    assert "#0 +method=grpo seed=1" in outs[0].stdout
    p = run("-m", "fspo.sweeps", "nosuch")
    assert p.returncode == 2 and p.stderr.startswith("error: unknown sweep 'nosuch'") and "Traceback" not in p.stderr


def _groups(help_text: str) -> set:
    section = help_text.split("== Configuration groups ==", 1)[1].split("== Config ==", 1)[0]
    return {ln.split(":", 1)[0] for ln in section.splitlines()[2:] if ":" in ln}


def test_help_lists_own_groups():
    train, ev = run("experiments/run.py", "--help"), run("experiments/evaluate.py", "--help")
    assert train.returncode == 0 and ev.returncode == 0, train.stderr[-2000:] + ev.stderr[-2000:]
    tg, eg = _groups(train.stdout), _groups(ev.stdout)
    all_groups = {p.name for p in CONF.iterdir() if p.is_dir()}
    assert tg == all_groups - {"eval_data"} and {"method", "clip", "experiment", "model"} <= tg
    assert eg == {"eval_data", "model", "reward", "rollout"}
    for out, app in ((train.stdout, "run.py"), (ev.stdout, "evaluate.py")):  # description, then 3 examples
        head = out.split("== Configuration groups ==")[0]
        assert out.startswith(f"{app}: ") and head.count(f"python experiments/{app}") == 3, head
    assert "fspo, grpo" not in ev.stdout.split("== Config ==")[0]  # no method list in evaluate's groups
