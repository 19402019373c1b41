"""The front door and the docs: README.md stays short, every relative link resolves, every docs page starts
with the command a user would type.

Owns: the checks of the documentation rules, on README.md and docs/*.md as committed:
- README.md has at most `README_MAX_LINES` lines;
- every relative Markdown link (``[text](path)`` or ``![alt](path)``) in README.md and docs/*.md names a
  file or folder that exists, resolved against the page's own folder (``#anchors`` are ignored; http(s),
  mailto and pure-anchor links are not checked);
- every docs page starts, right after its ``# title``, with a fenced code block of commands;
- README.md links every docs page (the table of links into docs/);
- the set-up names PyTorch's CPU wheel index and the GPU route, for users outside this project.
Leaves out: whether the commands work (tests/test_cli_keys.py checks their config keys; the tests of each
feature run them) and link anchors.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator, List, Tuple

import pytest

pytestmark = pytest.mark.docs  # a check of the docs and layout (runs by default; -m docs selects them)

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 150
PAGES = sorted((ROOT / "docs").glob("*.md"))
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _outside_code(text: str) -> Iterator[Tuple[int, str]]:
    """(line number, line) of the lines outside fenced code blocks."""
    fenced = False
    for i, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            yield i, line


def relative_links(page: Path) -> List[Tuple[int, str]]:
    """(line, target without its #anchor) of every relative link of ``page``, outside code blocks."""
    out = []
    for i, line in _outside_code(page.read_text()):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # http(s)://, mailto:, an anchor on the same page
            out.append((i, target.split("#", 1)[0]))
    return out


def test_readme_is_short():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= README_MAX_LINES, \
        f"README.md has {n} lines (at most {README_MAX_LINES}): move reference text into docs/"


def test_the_set_up_speaks_to_outside_users():
    """The torch line names PyTorch's CPU wheel index as such and says what to do on a GPU machine; nothing
    speaks of "our machines"."""
    text = (ROOT / "README.md").read_text()
    setup = text[text.index("## Set-up"):text.index("## ", text.index("## Set-up") + 3)]
    assert "--index-url https://download.pytorch.org/whl/cpu" in setup and "CPU wheel index" in setup
    assert "GPU machine" in setup and "docs/gpus.md" in setup
    assert "our machines" not in text


def test_there_are_docs_pages():
    assert len(PAGES) >= 4, [p.name for p in PAGES]


@pytest.mark.parametrize("page", [ROOT / "README.md", *PAGES], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page):
    broken = [f"{page.relative_to(ROOT)}:{i}: {t}" for i, t in relative_links(page)
              if not (page.parent / t).exists()]
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_docs_page_starts_with_a_command_block(page):
    lines = [ln for ln in page.read_text().splitlines() if ln.strip()]
    assert lines and lines[0].startswith("# "), f"{page.name}: the first line is not a '# title'"
    assert len(lines) > 2 and lines[1].startswith("```"), (
        f"{page.name}: the title is followed by {lines[1]!r}; start the page with a ``` block of the commands a "
        "user types")
    block = lines[2:lines.index("```", 2)] if "```" in lines[2:] else []
    commands = [ln for ln in block if ln.strip() and not ln.lstrip().startswith("#")]
    assert commands, f"{page.name}: its first code block is empty"


def test_readme_links_every_docs_page():
    linked = {t for _, t in relative_links(ROOT / "README.md")}
    missing = [p.name for p in PAGES if f"docs/{p.name}" not in linked]
    assert not missing, f"README.md's table of links into docs/ misses {missing}"


def test_link_finder_sees_links_and_skips_code_and_urls(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# t\n\n```bash\n[no](skipped.md)\n```\n[a](x.md#sec) ![f](img/y.png) [u](https://e.org/z)"
                    " [s](#here) [m](mailto:a@b)\n")
    assert relative_links(page) == [(6, "x.md"), (6, "img/y.png")]


def test_the_documented_two_file_method_composes_and_builds(tmp_path):
    """docs/architecture.md "Adding a clipping method": its conf/method/foo.yaml, with a real rule in place of
    the example's FooClip, composes with ``+method=foo`` and builds that rule with only the preset's settings."""
    import re
    import shutil

    from hydra.utils import instantiate

    from conftest import compose_config

    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Adding a clipping method", 1)[1]
    block = re.search(r"```yaml\n(.*?)```", section, re.S).group(1)
    preset = "\n".join(line[3:] if line.startswith("   ") else line for line in block.splitlines())
    preset = preset.replace("fspo.clipping.foo.FooClip", "fspo.clipping.grpo.GRPOClip").replace(
        "eps_low: 0.2", "clip_ratio_low: 0.1")
    conf = tmp_path / "conf"
    shutil.copytree(ROOT / "conf", conf)
    (conf / "method" / "foo.yaml").write_text(preset + "\n")
    cfg = compose_config(["+method=foo"], config_dir=conf)
    assert cfg.method == "foo" and dict(cfg.clip) == {"_target_": "fspo.clipping.grpo.GRPOClip", "clip_ratio_low": 0.1}
    assert type(instantiate(cfg.clip)).__name__ == "GRPOClip"


# where a reader of the product looks: a tracker's issue number there tells them nothing
PRODUCT_PATHS = ("fspo", "docs", "conf", "tests", "sweeps", "benchmarks", "README.md", "experiments")
ISSUE_NUMBER = re.compile(r"issue [0-9]+", re.IGNORECASE)


def issue_numbers(paths=PRODUCT_PATHS, root: Path = ROOT) -> List[str]:
    """``path:line: text`` for every "issue <number>" in the tracked text files under ``paths`` (binary files,
    those with a NUL byte or not UTF-8, are skipped)."""
    import subprocess

    listed = subprocess.run(["git", "ls-files", "-z", "--", *paths], cwd=root, capture_output=True)
    if listed.returncode != 0:
        pytest.skip(f"not a git checkout: {listed.stderr.decode(errors='replace').strip()}")
    hits = []
    for name in filter(None, listed.stdout.decode().split("\0")):
        path = root / name
        if not path.is_file():  # deleted in the work tree, not yet committed
            continue
        data = path.read_bytes()
        if b"\0" in data:
            continue
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        hits += [f"{name}:{i}: {line.strip()[:100]}" for i, line in enumerate(text.splitlines(), 1)
                 if ISSUE_NUMBER.search(line)]
    return hits


def test_no_issue_numbers_in_the_product():
    """Code, configs, docs, tests, sweeps, benchmarks and results say what a thing does and why, not which
    tracker item asked for it: no "issue <number>" in any tracked text file there."""
    hits = issue_numbers()
    assert not hits, f"{len(hits)} mention(s) of an issue number; say what and why instead:\n" + "\n".join(hits[:40])


def test_issue_number_finder_reads_tracked_text_and_skips_binary(tmp_path):
    import subprocess

    word = "Issue"  # written apart so that this file itself holds no match
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text(f"# a\nfixed in {word} 12 last week\nissue tracker, no number\n")
    (tmp_path / "docs" / "b.bin").write_bytes(f"\0{word} 7\0".encode())
    (tmp_path / "docs" / "c.txt").write_bytes(b"\xff\xfe" + f"{word} 8".encode())
    (tmp_path / "docs" / "untracked.md").write_text(f"{word} 9\n")
    (tmp_path / "other.md").write_text(f"{word} 10\n")
    subprocess.run(["git", "add", "docs/a.md", "docs/b.bin", "docs/c.txt", "other.md"], cwd=tmp_path, check=True)
    assert issue_numbers(("docs",), tmp_path) == [f"docs/a.md:2: fixed in {word} 12 last week"]
