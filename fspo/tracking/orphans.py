"""MLflow runs whose process died without ending them (``kill -9``, a lost node): found and marked KILLED.

Only runs carrying `owner_tags` are touched, only from the host that ran them, and a pid that is alive again
counts as dead only when its process started after the run; a run whose process may still live stays RUNNING.
"""
from __future__ import annotations

import logging
import os
import socket
import time
from typing import Dict, List

log = logging.getLogger(__name__)


def owner_tags() -> Dict[str, str]:
    """The tags that let a later process tell whether this one still writes the run."""
    return {"fspo.pid": str(os.getpid()), "fspo.host": socket.gethostname(), "fspo.started": f"{time.time():.0f}"}


def _alive(pid: int, started: float) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    try:
        import psutil

        return psutil.Process(pid).create_time() <= started + 5  # a later process with a reused pid: not ours
    except Exception:  # noqa: BLE001 - no psutil, or gone meanwhile: trust the signal probe
        return True


def end_orphans(client, experiment_id: str) -> List[str]:
    """Set KILLED every RUNNING run whose writing process is gone; returns their ids. Never raises."""
    ended: List[str] = []
    try:
        runs = client.search_runs([experiment_id], filter_string="attributes.status = 'RUNNING'", max_results=200)
    except Exception as e:  # noqa: BLE001
        log.debug("orphan runs: search failed: %s", e)
        return ended
    host = socket.gethostname()
    for run in runs:
        tags = run.data.tags
        try:
            pid, started = int(tags["fspo.pid"]), float(tags["fspo.started"])
        except (KeyError, ValueError):
            continue
        if tags.get("fspo.host") != host or pid == os.getpid() or _alive(pid, started):
            continue
        try:
            client.set_tag(run.info.run_id, "fspo.ended_by", f"its process (pid {pid} on {host}) was gone")
            client.set_terminated(run.info.run_id, "KILLED")
            ended.append(run.info.run_id)
        except Exception as e:  # noqa: BLE001
            log.debug("orphan run %s: %s", run.info.run_id, e)
    if ended:
        log.warning("marked %d MLflow run(s) KILLED whose process had died without ending them: %s", len(ended),
                    ", ".join(ended))
    return ended
