"""The layout of fspo/: dependencies point one way, and docs/architecture.md's "What is where" lists every module.

Owns: `LAYERS` (the packages of fspo/, lowest first) and the tests that
- every import between two packages of fspo/ (module-level or inside a function) goes from a higher
  layer to a lower one (the math knows no trainer, engine or tracker; data knows no update step);
- fspo/ holds no flat modules beyond the math contract and the entry points;
- every module file appears in docs/architecture.md's "What is where" block under its package.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Dict, List, Set, Tuple

import pytest

pytestmark = pytest.mark.docs  # a check of the docs and layout (runs by default; -m docs selects them)

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "fspo"

# lowest first; a package may import only from packages in earlier layers (and from itself)
LAYERS: List[Set[str]] = [
    {"types", "seeds"},
    {"losses", "advantages"},
    {"clipping"},
    {"diagnostics"},
    {"integrations"},
    {"models", "rewards", "data"},
    {"runtime"},
    {"rollout", "update"},
    {"config"},
    {"tracking"},
    {"evaluation"},
    {"cli"},
    {"train", "sweeps", ""},  # "": fspo/__init__.py, which stores the config schemas (fspo/config)
]
TOP_LEVEL_MODULES = {"types", "seeds", "losses", "advantages", "train", "cli", "sweeps"}


def _modules() -> Dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = p.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def import_edges() -> List[Tuple[str, str]]:
    """(importer, imported) for every import of one fspo module by another, lazy imports included."""
    mods = _modules()
    edges = []
    for m, p in mods.items():
        pkg = m if p.name == "__init__.py" else m.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")[:len(pkg.split(".")) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                cands = [f"{target}.{a.name}" for a in node.names] + [target]
            elif isinstance(node, ast.Import):
                cands = [a.name for a in node.names]
            else:
                continue
            for c in cands:
                if c in mods and c != m:
                    edges.append((m, c))
                    break
    return edges


def _package(module: str) -> str:
    return module.split(".")[1] if module.count(".") else ""


def _layer(package: str) -> int:
    for i, layer in enumerate(LAYERS):
        if package in layer:
            return i
    raise AssertionError(f"fspo.{package} is in no layer of tests/test_architecture.py LAYERS: place it there")


def test_every_package_has_a_layer():
    for p in PKG.iterdir():
        if p.suffix == ".py" and p.stem != "__init__" or (p.is_dir() and (p / "__init__.py").exists()):
            _layer(p.stem)


def test_dependencies_point_one_way():
    back = sorted({(a, b) for a, b in import_edges()
                   if _package(a) != _package(b) and _layer(_package(b)) >= _layer(_package(a))})
    listed = "\n".join(f"  {a} -> {b}" for a, b in back)
    assert not back, "imports against the layering (importer -> imported):\n" + listed


def test_no_flat_modules_beyond_the_contract_and_entry_points():
    flat = {p.stem for p in PKG.glob("*.py")} - {"__init__"}
    assert flat == TOP_LEVEL_MODULES, f"fspo/ holds {sorted(flat - TOP_LEVEL_MODULES)}: move them into a package"


ARCHITECTURE = ROOT / "docs" / "architecture.md"


def _readme_listing() -> Dict[str, Set[str]]:
    """{package path under fspo/ ('' for fspo/ itself): file names listed for it} from docs/architecture.md's block."""
    text = ARCHITECTURE.read_text()
    block = text.split("## What is where", 1)[1].split("```", 2)[1]
    listed: Dict[str, Set[str]] = {}
    current = None
    for line in block.splitlines():
        if line.startswith("fspo/"):
            current = ""
            continue
        if line and not line.startswith(" "):
            current = None  # conf/, experiments/
            continue
        head = re.match(r"^  ([a-z_/]+)/\s", line)
        if head:
            current = head.group(1)
        elif re.match(r"^  [a-z_]+\.py\b", line):
            current = ""
        if current is not None:
            listed.setdefault(current, set()).update(re.findall(r"\b([a-z_]+\.py)\b", line))
    return listed


def test_readme_lists_every_module():
    listed = _readme_listing()
    missing = []
    for p in PKG.rglob("*.py"):
        if p.name == "__init__.py":
            continue
        where = p.parent.relative_to(PKG).as_posix()
        where = "" if where == "." else where
        if p.name not in listed.get(where, set()):
            missing.append(p.relative_to(ROOT).as_posix())
    assert not missing, f"docs/architecture.md's 'What is where' does not list {missing}: add each under its package"


def test_readme_lists_no_module_that_is_gone():
    listed = _readme_listing()
    gone = [f"fspo/{where + '/' if where else ''}{name}" for where, names in listed.items() for name in names
            if not (PKG / where / name).exists()]
    assert not gone, f"docs/architecture.md's 'What is where' lists files that do not exist: {gone}"


# fspo/runtime/'s subpackages, lowest first (fspo/runtime/__init__.py): a subpackage imports only from earlier ones
RUNTIME_LAYERS = ["launch", "checkpoints", "checks"]


def test_runtime_subpackages_point_one_way():
    subs = {p.name for p in (PKG / "runtime").iterdir() if (p / "__init__.py").exists()}
    assert subs == set(RUNTIME_LAYERS), f"fspo/runtime/ holds {sorted(subs)}: place each in RUNTIME_LAYERS"
    assert not [p.name for p in (PKG / "runtime").glob("*.py") if p.name != "__init__.py"], \
        "fspo/runtime/ holds modules outside its subpackages: move them into launch/, checkpoints/ or checks/"

    def sub(m: str) -> str:
        parts = m.split(".")
        return parts[2] if len(parts) > 3 and parts[1] == "runtime" else ""

    back = sorted((a, b) for a, b in import_edges() if sub(a) and sub(b) and sub(a) != sub(b)
                  and RUNTIME_LAYERS.index(sub(b)) > RUNTIME_LAYERS.index(sub(a)))
    assert not back, f"imports against fspo/runtime's layering (launch <- checkpoints <- checks): {back}"
