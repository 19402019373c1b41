"""The version check every adapter runs before importing its library; `SUPPORTED` mirrors the ``fspo[verl]`` /
``fspo[trl]`` extras of pyproject.toml."""
from __future__ import annotations

from importlib import metadata
from typing import Dict, Tuple

from packaging.specifiers import SpecifierSet
from packaging.version import Version

#: distribution -> (tested range, extra of this package that installs it)
SUPPORTED: Dict[str, Tuple[str, str]] = {
    "verl": (">=0.9.1,<0.10", "verl"),
    "trl": (">=1.16.0,<1.17", "trl"),
}


def require(dist: str) -> str:
    """The installed version of ``dist`` if in ``SUPPORTED[dist]``'s range, else a one-line ImportError."""
    spec, extra = SUPPORTED[dist]
    try:
        found = metadata.version(dist)
    except metadata.PackageNotFoundError:
        found = None
    if found is not None and Version(found) in SpecifierSet(spec):
        return found
    what = "it is not installed" if found is None else f"found {dist} {found}"
    raise ImportError(f"fspo.integrations.{dist} needs {dist}{spec} ({what}); install it with: "
                      f"pip install 'fspo[{extra}]'  (or pip install '{dist}{spec}')")
