"""Reading the math data files: where they are, row validation, and the optional hub fallback.

Data never lives in the repository. The directory comes from, in order: ``data.data_dir``, the environment
variable ``FSPO_DATA_DIR``, and ``../shared/data``; a relative path is resolved against the project root, so it
means the same inside a Hydra run that changed directory, in tests and in scripts.
"""
from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Callable, List, Optional, Sequence, Tuple

log = logging.getLogger(__name__)

PROJECT_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DATA_DIR = "../shared/data"
ENV_DATA_DIR = "FSPO_DATA_DIR"
ON_BAD_ROW = ("raise", "skip")
_ESCAPED = re.compile("[\udc80-\udcff]")  # bytes that were not UTF-8, as errors="surrogateescape" reads them


class BadRow(Exception):
    """Raised by a row extractor: ``field`` is the offending field, ``reason`` what is wrong."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"field {field!r} {reason}")
        self.field, self.reason = field, reason


class DataRowError(ValueError):
    """A data row failed validation with ``on_bad_row='raise'``; the message names file, row, field."""


def resolve_data_dir(data_dir: Optional[str | os.PathLike] = None) -> Path:
    """The data directory as an absolute path."""
    raw = data_dir if data_dir not in (None, "") else os.environ.get(ENV_DATA_DIR) or DEFAULT_DATA_DIR
    p = Path(os.path.expanduser(str(raw)))
    return p if p.is_absolute() else (PROJECT_ROOT / p).resolve()


def require_str(row: Any, field: str, allow_int: bool = False, name: Optional[str] = None) -> str:
    """``row[field]`` as a non-empty stripped string (integers too when ``allow_int``), else `BadRow` naming
    ``name`` or ``field``."""
    name = name or field
    if not isinstance(row, dict):
        raise BadRow(name if name != field else "<row>", f"is not an object (got {type(row).__name__})")
    if field not in row or row[field] is None:
        raise BadRow(name, "is missing")
    v = row[field]
    if allow_int and isinstance(v, int) and not isinstance(v, bool):
        v = str(v)
    if not isinstance(v, str):
        raise BadRow(name, f"must be a string, got {type(v).__name__}")
    if not v.strip():
        raise BadRow(name, "is empty")
    return v.strip()


def _bad_byte(text: str) -> Optional[Tuple[int, int]]:
    """(byte value, index) of the first non-UTF-8 byte of ``text`` read with ``errors="surrogateescape"``, or None."""
    m = _ESCAPED.search(text)
    return None if m is None else (ord(m.group()) - 0xDC00, m.start())


def _has_bad_byte(x: Any) -> bool:
    """Whether any string in the record ``x`` holds a byte that was not UTF-8."""
    if isinstance(x, str):
        return _bad_byte(x) is not None
    if isinstance(x, dict):
        return any(_has_bad_byte(k) or _has_bad_byte(v) for k, v in x.items())
    return isinstance(x, list) and any(_has_bad_byte(v) for v in x)


def read_rows(path: Path) -> List[Tuple[int, Any]]:
    """(row number, record) pairs from a ``.jsonl`` (blank lines are not rows), ``.json`` (a top-level list) or
    ``.parquet`` file; a record that is not valid JSON or not UTF-8 becomes a ``BadRow``, so one bad byte costs
    one row, under ``on_bad_row``, not the file."""
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        out: List[Tuple[int, Any]] = []
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            for i, line in enumerate(f):
                if not line.strip():
                    continue
                bad = _bad_byte(line)
                if bad is not None:
                    where = f"0x{bad[0]:02x} at line {i + 1}, column {bad[1] + 1}"
                    out.append((i, BadRow("<utf-8>", f"holds a byte that is not UTF-8 ({where})")))
                    continue
                try:
                    out.append((i, json.loads(line)))
                except json.JSONDecodeError as e:
                    out.append((i, BadRow("<json>", f"is not valid JSON ({e.msg} at column {e.colno})")))
        return out
    if suffix == ".json":
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            text = f.read()
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}): fix the "
                             f"file (data.on_bad_row=skip skips bad records, not a broken file)") from None
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected a JSON list of records, got {type(data).__name__}")
        first = _bad_byte(text)
        if first is None:
            return list(enumerate(data))
        line_no = text.count("\n", 0, first[1])
        col = first[1] - (text.rfind("\n", 0, first[1]) + 1)
        where = f"the file's first: 0x{first[0]:02x} at line {line_no + 1}, column {col + 1}"
        return [(i, BadRow("<utf-8>", f"holds a byte that is not UTF-8 ({where})") if _has_bad_byte(r) else r)
                for i, r in enumerate(data)]
    if suffix == ".parquet":
        import pandas as pd

        return list(enumerate(_plain(r) for r in pd.read_parquet(path).to_dict(orient="records")))
    raise ValueError(f"{path}: unsupported file type {suffix!r} (expected .jsonl, .json or .parquet)")


def _plain(x: Any) -> Any:
    """numpy arrays / scalars from parquet -> lists / Python scalars (recursively)."""
    if hasattr(x, "tolist") and not isinstance(x, (str, bytes)):
        x = x.tolist()
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def hub_rows(hub_id: str, config: Optional[str], split: str) -> List[Tuple[int, Any]]:
    """Rows of a Hugging Face dataset (only when the local file is absent); the caller reports failures."""
    import datasets  # noqa: F401  (optional dependency)

    ds = datasets.load_dataset(hub_id, config, split=split)
    return list(enumerate(dict(r) for r in ds))


def open_source(data_dir: Path, filename: str, hub: Optional[Tuple[str, Optional[str], str]]
                ) -> Tuple[str, List[Tuple[int, Any]]]:
    """(label, rows) for ``data_dir/filename``, else from ``hub`` = (hub id, config, split); FileNotFoundError
    naming the file and the ``data.data_dir`` / ``FSPO_DATA_DIR`` settings otherwise."""
    path = data_dir / filename
    if path.is_file():
        return filename, read_rows(path)
    why = "no hub copy is known for it"
    if hub is not None:
        try:
            rows = hub_rows(*hub)
            log.warning("%s not found in %s; loaded hub dataset %s instead", filename, data_dir, hub[0])
            return f"hub:{hub[0]}", rows
        except Exception as e:  # ImportError, offline, auth...: report once, below
            why = f"the hub fallback {hub[0]!r} failed: {type(e).__name__}: {e}"
    raise FileNotFoundError(
        f"math data file {filename!r} not found in {data_dir} ({why}). Point the config key "
        f"data.data_dir (or the environment variable {ENV_DATA_DIR}) at the directory holding the "
        f"data files; relative paths are resolved against {PROJECT_ROOT}.")


class RowCollector:
    """Applies ``on_bad_row``: 'raise' -> `DataRowError` naming file, row and field; 'skip' -> the row is dropped,
    counted in ``skipped`` and logged (the first 5 individually, then a summary line)."""

    def __init__(self, label: str, on_bad_row: str):
        if on_bad_row not in ON_BAD_ROW:
            raise ValueError(f"on_bad_row must be one of {ON_BAD_ROW}, got {on_bad_row!r}")
        self.label, self.on_bad_row, self.skipped = label, on_bad_row, 0

    def collect(self, rows: Sequence[Tuple[int, Any]], extract: Callable[[int, Any], Any]) -> List[Any]:
        """``extract(row_number, record)`` for every row, applying the bad-row policy."""
        out = []
        for i, row in rows:
            try:
                if isinstance(row, BadRow):
                    raise row
                out.append(extract(i, row))
            except BadRow as e:
                msg = f"{self.label} row {i}: {e}"
                if self.on_bad_row == "raise":
                    raise DataRowError(msg + " (fix the file, or set data.on_bad_row=skip to skip bad rows)") from None
                self.skipped += 1
                if self.skipped <= 5:
                    log.warning("skipping bad row: %s", msg)
        if self.skipped:
            log.warning("%s: skipped %d bad row(s) of %d", self.label, self.skipped, len(rows))
        return out
