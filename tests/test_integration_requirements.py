"""Importing an adapter with a missing or unsupported library fails with one line naming the tested
range and the install command (fspo/integrations/requirements.py), in a fresh process, before the
library is imported; the ranges are the pyproject extras'."""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO
from fspo.integrations.requirements import SUPPORTED

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

PATCH = """
import importlib.metadata as md
real = md.version
def fake(dist):
    if dist == {dist!r}:
        if {found!r} is None:
            raise md.PackageNotFoundError(dist)
        return {found!r}
    return real(dist)
md.version = fake
import fspo.integrations.{dist}
"""


@pytest.mark.parametrize("dist, found", [("verl", None), ("verl", "0.8.0"), ("verl", "0.10.0"),
                                         ("trl", None), ("trl", "0.29.0"), ("trl", "1.17.0")])
def test_unsupported_version_is_one_line(dist, found):
    out = subprocess.run([sys.executable, "-c", PATCH.format(dist=dist, found=found)], capture_output=True,
                         text=True, timeout=300, cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": ""})
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    spec, extra = SUPPORTED[dist]
    what = "it is not installed" if found is None else f"found {dist} {found}"
    assert last == (f"ImportError: fspo.integrations.{dist} needs {dist}{spec} ({what}); install it with: "
                    f"pip install 'fspo[{extra}]'  (or pip install '{dist}{spec}')")
    assert f"\nimport {dist}" not in out.stderr and f"from {dist}" not in out.stderr  # failed before importing it


def test_extras_state_the_supported_ranges():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for dist, (spec, extra) in SUPPORTED.items():
        assert f"{dist}{spec}" in extras[extra], (extra, extras.get(extra))
