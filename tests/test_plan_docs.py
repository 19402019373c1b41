"""The dry-run outputs and plan tables in docs/ are the code's (benchmarks/plan_docs.py): each page
rendered again equals the page, so a page never shows a peak the command does not print. To refresh after a
change to the plan: ``python benchmarks/plan_docs.py``."""
from __future__ import annotations

import importlib.util

import pytest

from conftest import REPO

pytestmark = pytest.mark.docs  # a check of the docs and layout (runs by default; -m docs selects them)

_spec = importlib.util.spec_from_file_location("plan_docs", REPO / "benchmarks" / "plan_docs.py")
plan_docs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plan_docs)
BLOCK, DOCS, TABLE, render = plan_docs.BLOCK, plan_docs.DOCS, plan_docs.TABLE, plan_docs.render

PAGES = [p for p in sorted(DOCS.glob("*.md")) if BLOCK.search(p.read_text()) or TABLE.search(p.read_text())]


def test_the_pages_with_plans():
    assert {p.name for p in PAGES} >= {"gpus.md", "lora.md"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_docs_plans_are_the_codes(page):
    text = page.read_text()
    assert render(text) == text, f"{page.name} is stale: run python benchmarks/plan_docs.py"


def test_render_fills_a_block_and_a_table():
    page = ("```\n$ python experiments/run.py +model=qwen3_1_7b dry_run=true memory_plan.device_gib=1000\nold\n```\n"
            "<!-- plan-table -->\n| command | peak | usable | result |\n|---|---|---|---|\n"
            "| `+model=qwen3_1_7b memory_plan.device_gib=1000` | 1 | 2 | 3 |\n<!-- /plan-table -->\n")
    out = render(page)
    assert "old" not in out and "dry run: qwen3_1_7b" in out and "fits: peak" in out
    assert "| `+model=qwen3_1_7b memory_plan.device_gib=1000` | " in out and "| 900.00 | fits |" in out
