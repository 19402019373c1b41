"""The dry-run outputs shown in docs/, generated from the code: ``python benchmarks/plan_docs.py [PAGE ...]``
rewrites them, tests/test_plan_docs.py fails when one is stale.

Owns: `dry_run_output` (what ``python experiments/run.py ARGS`` prints for a dry run, in process: placement,
auto-fit, the plan; a refusal as its one ``error:`` line), `table_row` (one row of a plan table: peak,
usable, fits or refused) and `render` (a page with every block that starts with ``$ python
experiments/run.py ... dry_run=true ...`` and every ``<!-- plan-table -->`` table refreshed). Placement is that of
`MACHINE` (a GPU per process, vLLM not installed), so the pages do not depend on the machine that writes them. Leaves
out: the plan itself (memory_plan.py, auto_fit.py).
"""
from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path
from typing import List

from fspo.runtime.launch.placement import Machine

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
MACHINE = Machine(cuda=True, gpus=1, world=1, vllm=False)
BLOCK = re.compile(r"(```\n\$ python experiments/run\.py (?P<args>[^\n]*dry_run=true[^\n]*)\n)(?P<body>.*?)(```)", re.S)


def _placed(args: str, lines: List[str]):
    """The config of ``python experiments/run.py ARGS`` after placement and auto-fit (its line in ``lines``)."""
    from hydra import compose, initialize_config_dir

    from fspo.cli import normalize_group_overrides
    from fspo.runtime.checks.config_check import check_config
    from fspo.runtime.launch.auto_fit import auto_fit
    from fspo.runtime.launch.placement import place

    argv = normalize_group_overrides(shlex.split(args), "config")
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3", job_name="plan_docs"):
        cfg = compose(config_name="config", overrides=argv)
    place(cfg, argv, MACHINE)
    check_config(cfg)
    auto_fit(cfg, argv, out=lines.append)
    return cfg


def dry_run_output(args: str) -> str:
    """The lines ``python experiments/run.py ARGS`` (with ``dry_run=true``) prints, less the log lines."""
    from fspo.runtime.launch.memory_plan import MemoryPlanError, dry_run

    lines: List[str] = []
    cfg = _placed(args, lines)
    try:
        dry_run(cfg, out=lines.append)
    except MemoryPlanError as e:
        lines.append(f"error: MemoryPlanError: {e}")
    return "\n".join(lines) + "\n"


def table_row(args: str) -> str:
    """``| `ARGS` | peak GiB | usable GiB | fits / refused (what auto-fit chose) |`` for ``dry_run=true ARGS``."""
    from fspo.runtime.launch.memory_components import GIB
    from fspo.runtime.launch.memory_plan import _plan

    lines: List[str] = []
    cfg = _placed(args + " dry_run=true", lines)
    _, _, plan, avail, _, headroom = _plan(cfg, None)
    usable = headroom * avail
    chose = lines[0].split(": peak")[0].removeprefix("auto-fit: ") if lines else ""
    verdict = ("fits" if plan.peak <= usable else "refused") + (f" (auto-fit: {chose})" if chose else "")
    return f"| `{args}` | {plan.peak / GIB:.2f} | {usable / GIB:.2f} | {verdict} |"


TABLE = re.compile(r"(<!-- plan-table -->\n[^\n]*\n\|[-|]+\|\n)(?P<rows>.*?)(<!-- /plan-table -->)", re.S)


def render(text: str) -> str:
    """``text`` with the output of every dry-run block replaced by `dry_run_output` of its command, and
    every plan table's rows by `table_row` of their first cell's command."""
    text = BLOCK.sub(lambda m: m.group(1) + dry_run_output(m.group("args")) + m.group(4), text)

    def rows(m):
        cmds = re.findall(r"^\| `([^`]*)` \|", m.group("rows"), re.M)
        return m.group(1) + "".join(table_row(c) + "\n" for c in cmds) + m.group(3)

    return TABLE.sub(rows, text)


def main(pages: List[Path]) -> int:
    for page in pages:
        old = page.read_text()
        new = render(old)
        if new != old:
            page.write_text(new)
            print(f"updated {page.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pages", nargs="*", help="docs pages to refresh (default: every docs/*.md)")
    sys.exit(main([Path(p).resolve() for p in ap.parse_args().pages] or sorted(DOCS.glob("*.md"))))
