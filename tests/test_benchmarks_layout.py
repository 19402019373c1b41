"""Where the scripts live: experiments/ holds only the entry points, benchmarks/ the benchmark and
check scripts, each listed in benchmarks/README.md, and nothing puts the repository on ``sys.path`` by hand.

Owns: those layout rules, and that every benchmark script starts as a file from another folder (its shared
code, benchmarks/_common.py, found as the script's neighbour; fspo found as the installed package).
Leaves out: what the benchmarks measure (tests/test_bench_trl.py, test_meta_load.py, test_math_reward.py,
test_integration_trl.py / _verl.py and test_vllm_correction.py run them).
"""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.docs  # a check of the docs and layout (runs by default; -m docs selects them)

ENTRY_POINTS = {"run.py", "evaluate.py", "report.py", "warmstart.py", "gpu_smoke.py", "export_lora.py"}
BENCH = REPO / "benchmarks"
SCRIPTS = sorted(p.name for p in BENCH.iterdir() if p.suffix in (".py", ".sh") and not p.name.startswith("_"))


def test_experiments_holds_only_the_entry_points():
    found = {p.name for p in (REPO / "experiments").glob("*.py")}
    assert found == ENTRY_POINTS and len(found) <= 6, f"experiments/ holds {sorted(found - ENTRY_POINTS)}: " \
        "benchmarks and checks go to benchmarks/ (listed in benchmarks/README.md)"


def test_benchmarks_readme_lists_every_script_and_only_existing_ones():
    text = (BENCH / "README.md").read_text()
    listed = set(re.findall(r"^\| `([\w.]+)` \|", text, flags=re.M))
    assert listed == set(SCRIPTS), f"not listed: {sorted(set(SCRIPTS) - listed)}; gone: {sorted(listed - set(SCRIPTS))}"
    named = set(re.findall(r"benchmarks/([\w.]+\.(?:py|sh))", text))
    assert named <= set(SCRIPTS) | {"_common.py"}, sorted(named - set(SCRIPTS))


def test_no_sys_path_edits():
    skip = (".venv", ".git", "outputs", "multirun", "mlruns")
    offenders = [str(p.relative_to(REPO)) for p in REPO.rglob("*.py")
                 if not any(part.startswith(skip) for part in p.relative_to(REPO).parts)
                 and re.search(r"sys\.path\.(insert|append)\(", p.read_text(errors="replace"))]
    assert not offenders, f"{offenders} edit sys.path: import the installed fspo (pip install -e .), " \
        "a test's neighbours through tests/ (pytest's path) and benchmarks/_common.py as a neighbour"


# verl_fspo_check.py has no --help (it runs the check: tests/test_integration_verl.py runs it as the docs
# write it); vllm_api_scan.py imports only the standard library
@pytest.mark.slow
@pytest.mark.parametrize("script", [s for s in SCRIPTS if s.endswith(".py")
                                    and s not in ("verl_fspo_check.py", "vllm_api_scan.py")])
def test_benchmark_script_starts_from_another_folder(script, tmp_path):
    p = subprocess.run([sys.executable, str(BENCH / script), "--help"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.startswith("usage:"), p.stderr[-2000:]
