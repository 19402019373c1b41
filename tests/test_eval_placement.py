"""Where an evaluation writes: beside the run it scores, ``<run>/eval/<date_time>``, and its
MLflow run is named after that run (experiments/evaluate.py `beside_run`, `_eval_run_name`)."""
from __future__ import annotations

import importlib.util

import pytest

from conftest import REPO

spec = importlib.util.spec_from_file_location("evaluate_entry", REPO / "experiments" / "evaluate.py")
ev = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ev)
STAMP = "${now:%Y-%m-%d_%H-%M-%S}"


@pytest.fixture
def run(tmp_path):
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "step_000010.ckpt").write_bytes(b"x")
    return tmp_path / "run"


@pytest.mark.parametrize("spec", ["run", "run/checkpoints", "run/checkpoints/step_000010.ckpt"])
def test_eval_goes_beside_the_run(run, spec):
    arg = f"checkpoints={run.parent / spec}"
    assert ev.beside_run([arg, "limit=2"]) == [arg, "limit=2", f"hydra.run.dir={run}/eval/{STAMP}"]


def test_explicit_folders_globs_and_lists_are_left_alone(run):
    for argv in ([f"checkpoints={run}", "hydra.run.dir=/x"], [f"checkpoints={run}", "output_dir=/y"],
                 [f"checkpoints={run}/checkpoints/*.ckpt"], [f"checkpoints=[{run},{run}]"], ["limit=2"],
                 [f"checkpoints={run.parent}"]):  # no checkpoints/ folder there: not a run folder
        assert ev.beside_run(list(argv)) == list(argv)


def test_eval_run_is_named_after_the_training_run(run):
    ck = [run / "checkpoints" / "step_000010.ckpt"]
    assert ev._eval_run_name("sqlite:///nowhere.db", None, ck) == "eval-run"
    assert ev._eval_run_name("sqlite:///nowhere.db", None, []) is None
