"""Evaluating the default run: the built-in task's held-out evaluation set, and benchmarks that
cannot fit the model's context refused before anything runs.

Owns: the test split of fspo/data/arithmetic.py (disjoint from train and validation), the choice of
conf/eval_data/arithmetic.yaml for a built-in-task run (fspo/evaluation/eval_sets.py), the up-front
context check (fspo/evaluation/benchmark.py `check_fits_context`), and end to end: a tiny default-config
run trained for 2 steps, then the README's `experiments/evaluate.py checkpoints=<dir> include_base=true`
on its output folder (with `limit=8 k=2` to keep it to seconds), the run and the evaluations each as their
script in one subprocess. No mocks.
"""
from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from fspo.data.arithmetic import ArithmeticTask, _generate
from fspo.data.math_io import resolve_data_dir
from fspo.evaluation.benchmark import check_fits_context
from fspo.evaluation.eval_sets import build_benchmarks, select_eval_data
from fspo.models.tiny import build_tokenizer

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
EVALUATE = REPO / "experiments" / "evaluate.py"


def _prompts(src) -> set:
    return {src[i].prompt for i in range(len(src))}


def test_test_split_is_disjoint_from_train_and_val():
    """2-3 single-digit operands: only 162 + 1,458 distinct prompts, so raw draws from the test seed do
    repeat train and val prompts; the test split removes every one of them."""
    kw = dict(seed=0, min_ops=2, max_ops=3, max_operand=9)
    train = ArithmeticTask("train", 400, **kw)
    val = ArithmeticTask("val", 100, exclude_size=400, **kw)
    test = ArithmeticTask("test", 100, exclude_size=400, val_size=100, **kw)
    raw = {s.prompt for s in _generate(100, 0 + 2_000_003, 2, 3, 9)}
    assert raw & _prompts(train) and raw & _prompts(val)  # without the exclusion they would overlap
    assert len(test) == 100
    assert not _prompts(test) & _prompts(train) and not _prompts(test) & _prompts(val)
    s = test[0]  # the answer is the expression's value
    assert s.prompt.startswith("Q:") and int(s.answer) == eval(s.prompt[2:].split("\n")[0])  # noqa: S307
    with pytest.raises(ValueError, match="'train', 'val' or 'test'"):
        ArithmeticTask("eval", 10)


def _eval_cfg(overrides=()):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3", job_name="test_eval_default"):
        return compose(config_name="evaluate", overrides=list(overrides))


def test_builtin_run_gets_the_arithmetic_eval_set_with_its_settings():
    run_cfg = OmegaConf.create({
        "data": {"train": {"_target_": "fspo.data.arithmetic.ArithmeticTask", "split": "train", "size": 500,
                           "seed": 7, "min_ops": 2, "max_ops": 4, "max_operand": 9},
                 "val": {"_target_": "fspo.data.arithmetic.ArithmeticTask", "split": "val", "size": 16}},
        "val": {"size": 16}, "rollout": {"sampling": {"max_new_tokens": 24}}})
    cfg = _eval_cfg(["limit=5"])
    assert set(cfg.eval_data) == {"math500", "aime24", "aime25"} and cfg.eval_data_auto
    select_eval_data(cfg, run_cfg)
    assert list(cfg.eval_data) == ["arithmetic"]
    src = cfg.eval_data.arithmetic.source
    assert (src.split, src.seed, src.max_ops, src.exclude_size, src.val_size) == ("test", 7, 4, 500, 16)
    b = build_benchmarks(cfg)["arithmetic"]
    assert (len(b.source), b.k, b.max_new_tokens) == (5, 4, 24)  # limit cuts the set; the run's val budget
    assert b.reward["_target_"] == "fspo.rewards.arithmetic.ArithmeticReward"
    train = ArithmeticTask("train", 500, seed=7, min_ops=2, max_ops=4)
    assert not _prompts(b.source) & _prompts(train)
    # eval_data given on the command line (main() sets eval_data_auto=false) is kept; so is a math run's
    explicit = _eval_cfg(["eval_data=[gsm8k]", "eval_data_auto=false"])
    select_eval_data(explicit, run_cfg)
    assert list(explicit.eval_data) == ["gsm8k"]
    math_run = OmegaConf.create({"data": {"train": {"_target_": "fspo.data.math_datasets.load_math_source"}}})
    other = _eval_cfg()
    select_eval_data(other, math_run)
    assert set(other.eval_data) == {"math500", "aime24", "aime25"}


def test_context_check_names_benchmark_prompt_and_context():
    """A 300-operand prompt is "Q:" + 300 digits + 299 signs + "\\nA:" = 604 characters = 604 tokens of
    the character-level tokenizer: no room in a 512-token context."""
    tok = build_tokenizer()
    long = ArithmeticTask("test", 2, min_ops=300, max_ops=300, exclude_size=2, val_size=2)
    with pytest.raises(ValueError) as err:
        check_fits_context("arith_long", long, tok, 128, 512)
    msg = str(err.value)
    assert "benchmark arith_long does not fit the model" in msg
    assert "longest prompt is 604 tokens" in msg and "context is 512" in msg and "eval_data=" in msg
    assert check_fits_context("arith_long", long, tok, 128, 605) == 1  # one new token fits
    assert check_fits_context("arith_long", long, tok, 128, 1000) == 128
    with pytest.raises(ValueError, match="fit_context=true"):
        check_fits_context("arith_long", long, tok, 128, 700, fit_context=False)
    with pytest.raises(ValueError, match="max_prompt_len=600"):
        check_fits_context("arith_long", long, tok, 8, None, max_prompt_len=600)


# ----------------------------------------------------------------------------------- end to end
def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


LONG = "eval_data.arithmetic.source."
TOO_LONG = ["eval_data=[arithmetic]", "eval_data.arithmetic.from_run=false", f"{LONG}size=2", f"{LONG}min_ops=300",
            f"{LONG}max_ops=300", f"{LONG}exclude_size=2", f"{LONG}val_size=2"]


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """(tmp folder, run folder, tracking URI, {"readme": ..., "too_long": ...}): the default config (warm-started
    tiny model, built-in task) trained for 2 steps of 4 prompts x 4 samples, one checkpoint at the end; then, in
    this order, experiments/evaluate.py refusing a benchmark too long for the model (its output_dir
    <tmp>/eval_long) and the README's evaluate command on the run. The three commands run once per session in one
    interpreter (conftest.run_py_cases), each as its script, the store shared through MLFLOW_TRACKING_URI."""
    from conftest import run_py_cases

    def cases(tmp):
        run_dir, uri = tmp / "train" / "run", f"sqlite:///{tmp / 'mlflow.db'}"
        return {"train": (["steps=2", "prompts_per_step=4", "rollout.sampling.n=4", "ppo.mini_batch_size=8",
                           "ppo.mini_batch_unit=sequences", "val.size=8", f"output_dir={run_dir}",
                           f"logger.tracking_uri={uri}", f"+logger.artifact_location={tmp / 'artifacts'}"], {}),
                "too_long": ([f"checkpoints={run_dir}", "include_base=true", f"output_dir={tmp / 'eval_long'}",
                              *TOO_LONG], {"MLFLOW_TRACKING_URI": uri}, EVALUATE),
                "readme": ([f"checkpoints={run_dir}", "include_base=true", "limit=8", "k=2"],
                           {"MLFLOW_TRACKING_URI": uri}, EVALUATE)}

    get = run_py_cases(tmp_path_factory, "eval_default", cases, _env())
    p, _, folder = get("train")
    tmp, run_dir = folder.parent, folder / "run"
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert (run_dir / "checkpoints" / "step_000002.ckpt").exists()
    return tmp, run_dir, f"sqlite:///{tmp / 'mlflow.db'}", {c: get(c)[0] for c in ("readme", "too_long")}


def _runs(uri: str) -> list:
    with sqlite3.connect(uri[len("sqlite:///"):]) as db:
        return db.execute("SELECT run_uuid, status FROM runs").fetchall()


@pytest.mark.slow
def test_readme_evaluate_command_on_the_default_run(default_run):
    tmp, run_dir, uri, evals = default_run
    p = evals["readme"]
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "evaluating on eval_data=[arithmetic]" in p.stdout + p.stderr
    outs = list((run_dir / "eval").iterdir())  # written beside the run it scores: <run>/eval/<date_time>
    assert len(outs) == 1, outs
    out = outs[0]
    md = (out / "summary.md").read_text()  # <run>/eval/<date_time>/summary.md: "eval" once
    assert "| Benchmark | Base | Best | Best step | Last | Last step |" in md
    row = next(line for line in md.splitlines() if line.startswith("| arithmetic |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[3] == "2" and cells[5] == "2"  # best and last: the only checkpoint, step 2
    assert all(0.0 <= float(cells[i]) <= 1.0 for i in (1, 2, 4))  # fractions, the unit of MLflow and the console
    table = (out / "arithmetic" / "step_2" / "per_problem.json").read_text()
    assert '"k"' in table and "math500" not in md and "aime" not in md
    assert [s for _, s in _runs(uri)].count("FINISHED") == 2  # the training run and this evaluation
    with sqlite3.connect(uri[len("sqlite:///"):]) as db:  # named after the run it evaluates
        names = dict(db.execute("SELECT run_uuid, name FROM runs").fetchall())
    train_id = (run_dir / "mlflow_run_id").read_text().strip()
    assert f"eval-{names[train_id]}" in names.values(), names


@pytest.mark.slow
def test_too_long_benchmark_is_refused_before_any_run(default_run):
    tmp, run_dir, uri, evals = default_run
    p = evals["too_long"]
    assert p.returncode == 2, p.stdout[-3000:] + p.stderr[-3000:]
    err = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(err) == 1, p.stderr[-3000:]
    assert "benchmark arithmetic does not fit the model: its longest prompt is 604 tokens" in err[0]
    assert "context is 512" in err[0] and "eval_data=" in err[0] and "longer context" in err[0]
    # it ran after the training run and before the README's evaluation: the store holds those two runs only,
    # both FINISHED (no MLflow run created by the refusal, none left FAILED)
    train_id = (run_dir / "mlflow_run_id").read_text().strip()
    runs = dict(_runs(uri))
    assert len(runs) == 2 and runs[train_id] == "FINISHED" and set(runs.values()) == {"FINISHED"}, runs
    assert not (tmp / "eval_long" / "eval").exists()


@pytest.mark.slow
@pytest.mark.skipif(not (resolve_data_dir(None) / "math500_test.jsonl").exists(), reason="no MATH500 data file")
def test_math_benchmarks_on_the_tiny_model_are_refused_up_front(tmp_path):
    """The evaluator's default benchmarks (MATH500, AIME) on the tiny model (context 512): MATH500's
    longest prompt already exceeds it, so the first benchmark is named and nothing is scored or logged."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {**_env(), "MLFLOW_TRACKING_URI": uri, "FSPO_DATA_DIR": str(resolve_data_dir(None))}
    p = subprocess.run([sys.executable, str(EVALUATE), f"output_dir={tmp_path / 'out'}"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 2, p.stdout[-3000:] + p.stderr[-3000:]
    err = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "benchmark math500 does not fit the model: its longest prompt is" in err[0]
    assert "context is 512" in err[0]
    db = tmp_path / "mlflow.db"
    if db.exists() and _has_runs_table(db):  # the store may not even be created
        assert _runs(uri) == []
    assert not (tmp_path / "out" / "eval").exists()


def _has_runs_table(db: Path) -> bool:
    with sqlite3.connect(db) as con:
        return bool(con.execute("SELECT name FROM sqlite_master WHERE name = 'runs'").fetchall())
