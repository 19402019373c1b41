"""Shared test fixtures: composing the project's Hydra config and the small settings used by the
end-to-end tests.

Owns: `REPO`, `CONF`, `SMALL` (the overrides that make a run take seconds on a CPU: random tiny
model, 2 RL steps of 4 prompts x 4 samples, mini-batches of 8 so each step has 2 optimizer updates
and the second one sees non-zero log-ratios, 24 new tokens, 8 validation prompts), the
`compose_cfg` fixture (root config + overrides, with ``output_dir`` and the MLflow store pointed
into the test's temporary folder) and `mlflow_uri` (one SQLite store per test session: creating the
MLflow schema costs seconds, so tests share the store and separate their runs by experiment name).

`torchrun` launches multi-process tests with each worker's log kept whole and shown when the launch fails.

Torch runs single-threaded in tests: the CI machines have 2 cores shared by several jobs, and the
tiny model gains nothing from intra-op threads.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

import pytest
import torch
from omegaconf import DictConfig, open_dict

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"

SMALL = [
    "model.source=random",
    "steps=2",
    "prompts_per_step=4",
    "rollout.sampling.n=4",
    "ppo.mini_batch_size=8", "ppo.mini_batch_unit=sequences",
    "rollout.sampling.max_new_tokens=24",
    "val.size=8",
]

torch.set_num_threads(1)


def torchrun(script: Path, args: Sequence[str], log_dir: Path, nproc: int = 2, cwd: Optional[Path] = None,
             env: Optional[dict] = None, timeout: int = 840) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc_per_node=nproc script *args`` (one thread per worker). Each worker's
    stdout and stderr go whole to files under ``log_dir`` (torchrun's ``--log-dir``/``--redirects``); when the
    launch exits non-zero the test fails showing every worker's full log, not a tail that may cut the first
    error off."""
    env = dict(os.environ if env is None else env, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false")
    log_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "--log-dir", str(log_dir), "--redirects", "3", str(script), *map(str, args)]
    proc = subprocess.run(cmd, env=env, cwd=str(cwd or REPO), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"torchrun exited {proc.returncode}\n{worker_logs(log_dir)}\n--- launcher stderr (tail)\n"
                    f"{proc.stderr[-3000:]}", pytrace=False)
    return proc


def worker_logs(log_dir: Path) -> str:
    """Every worker log file under ``log_dir`` (torchrun's ``<run>/attempt_<n>/<rank>/std{out,err}.log``), whole."""
    parts = [f"--- {p.relative_to(log_dir)}\n{p.read_text(errors='replace')}"
             for p in sorted(log_dir.rglob("*.log")) if p.stat().st_size]
    return "\n".join(parts) or f"(no worker log under {log_dir})"


def torchrun_two_ranks(worker: Path, out: Path, scenarios: str, timeout: int = 840) -> Path:
    """Run ``worker out scenarios`` on 2 gloo ranks with `torchrun` (worker logs under ``out/logs``, shown
    whole when it fails). Returns ``out``."""
    torchrun(worker, [out, scenarios], out / "logs", timeout=timeout)
    return out


def sweep_arms(sweep: str) -> dict:
    """{arm name: resolved job config} of sweeps/<sweep>.yaml's default grid (jobs read the parent run id
    from the environment, set by the Hydra callback at launch; a placeholder stands in for it here)."""
    from omegaconf import OmegaConf

    from fspo.sweeps import job_config, sweep_jobs

    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FSPO_MLFLOW_PARENT_RUN_ID", "0123abcd")
        for job in sweep_jobs(sweep, []):
            (arm,) = [o.split("=", 1)[1] for o in job if o.startswith("+arm=")]
            cfg = job_config(sweep, job)
            OmegaConf.resolve(cfg)
            out[arm] = cfg
    return out


def run_in_process(main: Callable[[], object], argv: Sequence[str], cwd: Optional[Path] = None
                   ) -> subprocess.CompletedProcess:
    """``main()`` with ``sys.argv = argv`` (and the working directory ``cwd``) in this process, as a console
    script calls it: the exit code (``SystemExit``'s; a returned int; else 0) and what it printed to stdout and
    stderr. An exception other than SystemExit propagates (a traceback fails the test). For the one-line
    refusals and exports whose check does not need a fresh interpreter: it spares the 5-6 CPU-s of imports a
    ``python script.py`` subprocess pays."""
    import contextlib
    import io

    out, err, old_argv, old_cwd, code = io.StringIO(), io.StringIO(), sys.argv, os.getcwd(), 0
    try:
        sys.argv = [str(a) for a in argv]
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                ret = main()
                code = ret if isinstance(ret, int) else 0
            except SystemExit as e:
                if isinstance(e.code, str):  # as the interpreter does: the message to stderr, exit code 1
                    print(e.code, file=sys.stderr)
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = old_argv
        os.chdir(old_cwd)
    return subprocess.CompletedProcess(list(argv), code, out.getvalue(), err.getvalue())


def run_script_in_process(script: Path, args: Sequence[str], cwd: Optional[Path] = None
                          ) -> subprocess.CompletedProcess:
    """`run_in_process` of ``python <script> *args``: the file run as ``__main__`` (runpy), argv[0] the file."""
    import runpy

    return run_in_process(lambda: runpy.run_path(str(script), run_name="__main__"), [script, *args], cwd)


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for a test's own process group (gloo / vLLM rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(target: Callable, args: Callable, n: int = 2) -> dict:
    """Run ``target(*args(rank, port, queue))`` in ``n`` spawned processes sharing one free port; each
    puts ``(rank, result)`` on the queue. Returns {rank: result}; every process must exit 0."""
    ctx = torch.multiprocessing.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=target, args=args(r, port, queue)) for r in range(n)]
    for p in procs:
        p.start()
    out = dict(queue.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return out


def compose_config(overrides: Iterable[str] = (), output_dir: Optional[Path] = None,
                   tracking_uri: Optional[str] = None, artifact_location: Optional[Path] = None,
                   config_name: str = "config", config_dir: Path = CONF,
                   return_hydra_config: bool = False) -> DictConfig:
    """The primary config ``config_name`` (default conf/config.yaml) composed with ``overrides`` as
    on the command line.

    ``output_dir`` / ``tracking_uri`` / ``artifact_location`` replace the run folder, the MLflow
    store and the MLflow artifact root (which would otherwise default to ./mlruns in the cwd).
    A ``config_dir`` other than conf/ (e.g. sweeps/) gets conf/ on its search path, as
    ``experiments/run.py --config-dir sweeps --config-name X`` has.
    """
    from hydra import compose, initialize_config_dir

    import fspo  # noqa: F401  (stores the config schemas that conf/ extends)

    overrides = list(overrides)
    if Path(config_dir).resolve() != CONF:
        overrides = [f"hydra.searchpath=[file://{CONF}]", *overrides]
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3", job_name="test"):
        cfg = compose(config_name=config_name, overrides=overrides, return_hydra_config=return_hydra_config)
    with open_dict(cfg):
        if output_dir is not None:
            cfg.output_dir = str(output_dir)
        if tracking_uri is not None and "logger" in cfg:
            cfg.logger.tracking_uri = tracking_uri
        if artifact_location is not None and "logger" in cfg:
            cfg.logger.artifact_location = str(artifact_location)
    return cfg


@pytest.fixture(scope="session")
def mlflow_dir(tmp_path_factory) -> Path:
    """A session-wide folder holding the shared MLflow SQLite store and its artifacts."""
    return tmp_path_factory.mktemp("mlflow")


@pytest.fixture(scope="session")
def mlflow_uri(mlflow_dir) -> str:
    """``sqlite:///<tmp>/mlflow.db``, shared by the session's tests (see the module docstring)."""
    return f"sqlite:///{mlflow_dir / 'mlflow.db'}"


def once_per_session(tmp_path_factory, name: str, make: Callable[[Path], None]) -> Path:
    """The folder ``<session tmp>/<name>``, filled by ``make(folder)`` once per test session, also under
    pytest-xdist (the workers share the session's temporary root; a file lock makes the others wait and
    reuse it). For an expensive artifact several tests only read, e.g. one tiny training run."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    folder, done = root / name, root / f"{name}.done"
    with FileLock(str(root / f"{name}.lock")):
        if not done.exists():
            if folder.exists():  # a failed attempt's leftovers
                import shutil

                shutil.rmtree(folder)
            folder.mkdir()
            make(folder)
            done.write_text("")
    return folder


# DRIVER runs experiments/run.py (or another entry point) unchanged as ``__main__`` (runpy) once per case in ONE
# interpreter that imported the heavy modules first (a fresh `python experiments/run.py` pays 5-6 CPU-s of imports
# each time): each case with its own argv, working directory, environment changes, stdout/stderr files and clock
# (seconds from the case's start to its exit, i.e. after the imports), in the order given
RUN_PY_DRIVER = """
import json, os, runpy, sys, time, traceback
import fspo.train  # noqa: F401  (torch, Lightning, ...)
import mlflow, lightning.pytorch.loggers  # noqa: F401,E401  (the MLflow logger imports them lazily)
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401  (load_policy imports them lazily)
from hydra.core.global_hydra import GlobalHydra
(cases_file, results_file), results = sys.argv[1:3], {}
for name, case in json.loads(open(cases_file).read()).items():
    script = case["script"]
    os.environ.update(case["env"])
    os.chdir(case["cwd"])
    files = [open(os.path.join(case["dir"], f), "w") for f in ("stdout.txt", "stderr.txt")]
    saved = [os.dup(1), os.dup(2)]
    sys.stdout, sys.stderr = files
    os.dup2(files[0].fileno(), 1)
    os.dup2(files[1].fileno(), 2)
    sys.argv, code, t0 = [script, *case["argv"]], 0, time.monotonic()
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001  (as the interpreter would: the traceback on stderr, exit 1)
        traceback.print_exc()
        code = 1
    results[name] = {"returncode": code, "seconds": time.monotonic() - t0}
    for f, fd, std in zip(files, saved, (1, 2)):
        f.flush()
        os.dup2(fd, std)
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    GlobalHydra.instance().clear()
open(results_file, "w").write(json.dumps(results))
"""


def run_py_cases(tmp_path_factory, name: str, make_cases: Callable[[Path], dict], env: Optional[dict] = None,
                 timeout: int = 900) -> Callable[[str], tuple]:
    """Run the cases ``make_cases(folder)`` returns, {case: (argv, environment changes[, script])}, through
    RUN_PY_DRIVER in one subprocess, once per test session (`once_per_session`); the script is experiments/run.py
    unless given; ``env`` is that process's environment (default: this one's; offline unless it sets
    HF_HUB_OFFLINE; one thread). Each case runs in its own folder ``folder/<case>`` (its working directory).
    Returns ``get(case)`` -> (CompletedProcess with the case's exit code, stdout and stderr; the seconds it took
    after the imports; its folder)."""
    import json

    def make(folder: Path) -> None:
        spec = {}
        for case, (argv, changes, *script) in make_cases(folder).items():
            (folder / case).mkdir(parents=True, exist_ok=True)
            spec[case] = {"argv": [str(a) for a in argv], "env": changes, "cwd": str(folder / case),
                          "dir": str(folder / case), "script": str(script[0] if script else REPO / "experiments" /
                                                                   "run.py")}
        (folder / "cases.json").write_text(json.dumps(spec))
        base = {"HF_HUB_OFFLINE": "1", **(os.environ if env is None else env), "OMP_NUM_THREADS": "1",
                "MKL_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.run([sys.executable, "-c", RUN_PY_DRIVER, folder / "cases.json", folder / "results.json"],
                              cwd=REPO, env=base, capture_output=True, text=True, timeout=timeout)
        assert proc.returncode == 0 and (folder / "results.json").is_file(), (proc.stdout + proc.stderr)[-4000:]

    folder = once_per_session(tmp_path_factory, name, make)
    results = json.loads((folder / "results.json").read_text())

    def get(case: str) -> tuple:
        r, d = results[case], folder / case
        proc = subprocess.CompletedProcess([case], r["returncode"], (d / "stdout.txt").read_text(),
                                           (d / "stderr.txt").read_text())
        return proc, r["seconds"], d

    return get


# cases of `entry_case` fixture: {name: (argv, environment changes, script or None)}, registered by the test modules
# when they are imported (every module is collected before a test runs, also on each xdist worker)
ENTRY_CASES: dict = {}


def register_entry_case(name: str, argv: Sequence[str], env: Optional[dict] = None, script: Optional[Path] = None):
    """Register an `experiments/run.py argv` case (``{dir}`` in argv and env values: the case's own folder) that
    fails or ends after the heavy imports; all registered cases run in one interpreter (see `entry_case`)."""
    ENTRY_CASES[name] = (list(argv), dict(env or {}), script)


@pytest.fixture(scope="session")
def entry_case(tmp_path_factory) -> Callable[[str], tuple]:
    """``entry_case(name)`` -> (CompletedProcess, seconds after the imports, the case's folder) of a registered
    case. Every case registered runs once per session, in one `run_py_cases` interpreter: offline, without
    HYDRA_FULL_ERROR, FSPO_DATA_DIR or any WANDB_* variable, a fresh HF_HOME, Python warnings off."""

    def cases(folder: Path) -> dict:
        def fill(text: str, name: str) -> str:
            return str(text).replace("{dir}", str(folder / name))

        return {name: ([fill(a, name) for a in argv], {k: fill(v, name) for k, v in env.items()},
                       *([script] if script else []))
                for name, (argv, env, script) in ENTRY_CASES.items()}

    env = {k: v for k, v in os.environ.items()
           if k not in ("HYDRA_FULL_ERROR", "FSPO_DATA_DIR") and not k.startswith("WANDB_")}
    env.update(HF_HOME=str(tmp_path_factory.getbasetemp() / "hf"), HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore")
    return run_py_cases(tmp_path_factory, "entry_cases", cases, env)


# the shared tiny run: conftest's SMALL on the warm-started tiny model (loaded with from_pretrained), 3 RL steps,
# a progress line every 2 steps; its run folder is run/, its store a relative sqlite:///store.db in the folder
TINY_RUN_ARGS = [o for o in SMALL if o not in ("model.source=random", "steps=2")] + ["steps=3",
                                                                                    "progress.every_n_steps=2"]


def tiny_run_command(folder: Path, out: Path, artifacts: Path) -> list:
    """``python experiments/run.py TINY_RUN_ARGS`` into run folder ``out`` and the store ``folder/store.db``."""
    return [sys.executable, str(REPO / "experiments" / "run.py"), *TINY_RUN_ARGS, f"hydra.run.dir={out}",
            "logger.tracking_uri=sqlite:///store.db", f"+logger.artifact_location={artifacts}"]


def tiny_run_env() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env.pop("MLFLOW_TRACKING_URI", None)
    return env


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> dict:
    """One real tiny training run (`experiments/run.py` as a subprocess, cwd its folder, output to pipes), shared
    by the tests that only read what it leaves: {"dir": folder, "out": run folder, "store": store.db,
    "stdout": ..., "stderr": ...}. It must exit 0."""

    def make(folder: Path) -> None:
        proc = subprocess.run(tiny_run_command(folder, folder / "run", folder / "artifacts"), cwd=folder,
                              env=tiny_run_env(), capture_output=True, text=True, timeout=600)
        (folder / "stdout.txt").write_text(proc.stdout)
        (folder / "stderr.txt").write_text(proc.stderr)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]

    folder = once_per_session(tmp_path_factory, "tiny_run", make)
    return {"dir": folder, "out": folder / "run", "store": folder / "store.db",
            "stdout": (folder / "stdout.txt").read_text(), "stderr": (folder / "stderr.txt").read_text()}


def clip_config(option: str) -> DictConfig:
    """The ``clip:`` node that ``clip=<option>`` composes (conf/clip/<option>.yaml on its stored schema)."""
    return compose_config([f"clip={option}"]).clip


@pytest.fixture
def compose_cfg(tmp_path, mlflow_dir, mlflow_uri) -> Callable[..., DictConfig]:
    """``compose_cfg(overrides)`` -> composed config with output_dir=<tmp_path>/out and the MLflow
    store ``sqlite:///<session tmp>/mlflow.db`` (artifacts under the same temporary folder)."""

    def _compose(overrides: Iterable[str] = ()) -> DictConfig:
        return compose_config(overrides, output_dir=tmp_path / "out", tracking_uri=mlflow_uri,
                              artifact_location=mlflow_dir / "artifacts")

    return _compose


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` (pyproject.toml) skip cleanly where torch sees no CUDA device (CI, this machine)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marker gpu); none is visible")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
