"""The file an MLflow run's writes go to while its tracking server is down.

JSONL: a header ``{"op": "header", "tracking_uri", "run_id"}``, then ``{"op": "log_batch", "run_id", "metrics":
[[key, value, timestamp_ms, step]...], "params": [[k, v]...], "tags": [[k, v]...]}`` and ``{"op":
"set_terminated", "run_id", "status", "end_time"}`` rows. Once ``max_bytes`` is reached newer metric rows are
refused and counted (the history kept is the start of the outage); status rows are always kept.
"""
from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any, Dict, List, Optional

log = logging.getLogger(__name__)

BUFFER_FILE = "mlflow_buffer.jsonl"
MAX_BYTES = 64 << 20


class OutageBuffer:
    """Append-only JSONL rows in ``path`` (header first), at most ``max_bytes``; thread-safe with `lock`."""

    def __init__(self, path: Path, tracking_uri: str, max_bytes: int = MAX_BYTES):
        self.path, self.tracking_uri, self.max_bytes = Path(path), str(tracking_uri), int(max_bytes)
        self.lock = threading.RLock()
        self.refused = 0
        self.set_aside = 0  # lines that were not rows of this buffer's run, moved to `aside_path`

    @property
    def aside_path(self) -> Path:
        """Where lines that cannot be imported (torn, malformed, another run's) are kept: never deleted."""
        return self.path.with_name(self.path.stem + ".unreadable.jsonl")

    def rows(self) -> List[Dict[str, Any]]:
        from fspo.tracking.replay import read_buffer

        return read_buffer(self.path).rows if self.path.exists() else []

    def _header(self, run_id: Optional[str]) -> str:
        return json.dumps({"op": "header", "tracking_uri": self.tracking_uri, "run_id": run_id}) + "\n"

    def append(self, row: Dict[str, Any]) -> bool:
        """Append ``row``; False (and counted) when a metric row would pass ``max_bytes``. A torn last line is
        ended first, so that it never swallows this row."""
        line = json.dumps(row, separators=(",", ":")) + "\n"
        with self.lock:
            size = self.path.stat().st_size if self.path.exists() else 0
            if row["op"] == "log_batch" and size + len(line) > self.max_bytes:
                self.refused += 1
                return False
            torn = False
            if size:
                with self.path.open("rb") as f:
                    f.seek(-1, os.SEEK_END)
                    torn = f.read(1) != b"\n"
            with self.path.open("a") as f:
                f.write(self._header(row.get("run_id")) if size == 0 else "\n" if torn else "")
                f.write(line)
                f.flush()
            return True

    def drop_first(self, n: int) -> int:
        """Remove the first ``n`` rows (sent); returns how many remain. Lines that are not rows of the buffer's
        run go to `aside_path`, not dropped."""
        from fspo.tracking.replay import read_buffer

        with self.lock:
            buf = read_buffer(self.path)
            if buf.bad:
                lines = self.path.read_text(errors="replace").splitlines()
                with self.aside_path.open("a") as f:
                    f.write("".join(lines[i - 1] + "\n" for i, _ in buf.bad))
                self.set_aside += len(buf.bad)
                log.warning("%d lines of %s could not be imported (%s): kept in %s", len(buf.bad), self.path,
                            buf.bad[0][1], self.aside_path)
            rest = buf.rows[n:]
            if not rest:
                self.path.unlink(missing_ok=True)
                return 0
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(self._header(buf.run_id) + "".join(json.dumps(r, separators=(",", ":")) + "\n"
                                                             for r in rest))
            tmp.replace(self.path)
            return len(rest)
