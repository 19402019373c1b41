"""Creating an MLflow SQLite store atomically, and what to do with one whose creation was interrupted.

MLflow migrates a new SQLite store in place (about a second); a kill inside that window leaves a file every
later open fails on. So a missing store is migrated in a temporary file and renamed into place: the path holds
nothing or a complete store. A half-migrated store with no runs (an interrupted creation) is moved aside to
``<name>.interrupted-<time>`` and created again; one that holds runs is never touched (`HalfMigratedStore`,
naming the fix). A complete store of an older schema is left to MLflow's own message.
"""
from __future__ import annotations

import contextlib
import logging
import os
import secrets
import sqlite3
import time
from pathlib import Path
from typing import Dict, Optional

log = logging.getLogger(__name__)
CREATING = ".creating-"


class HalfMigratedStore(ValueError):
    """A SQLite store with runs in it whose schema migration was interrupted."""


def _head_revision() -> str:
    from mlflow.store.db.utils import _get_latest_schema_revision  # MLflow's own head (no database needed)

    return _get_latest_schema_revision()


def store_state(path: Path) -> Dict[str, object]:
    """``{"version", "tables", "tmp_tables", "runs", "experiments"}`` of a SQLite file, read without MLflow."""
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=30)
    try:
        tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        version = con.execute("SELECT version_num FROM alembic_version").fetchone() if "alembic_version" in tables \
            else None
        count = {t: con.execute(f"SELECT count(*) FROM {t}").fetchone()[0] if t in tables else 0  # noqa: S608
                 for t in ("runs", "experiments")}
    finally:
        con.close()
    return {"version": version[0] if version else None, "tables": sorted(tables),
            "tmp_tables": sorted(t for t in tables if t.startswith("_alembic_tmp_")), **count}


def _build(path: Path) -> None:
    """Create a complete store at ``path`` through a temporary file renamed into place."""
    from mlflow.tracking import MlflowClient

    # a new name each time: MLflow caches its store per URI (a reused name would skip the migrations)
    tmp = path.with_name(f".{path.name}{CREATING}{os.getpid()}-{secrets.token_hex(4)}")
    try:
        client = MlflowClient(tracking_uri=f"sqlite:///{tmp}")
        client.search_experiments(max_results=1)  # creates and migrates the schema in tmp
        with contextlib.suppress(Exception):  # a store without an engine attribute: connections close at exit
            client._tracking_client.store.engine.dispose()  # close its connections before the rename
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _sweep_leftovers(path: Path) -> None:
    """Remove temporary stores of attempts whose process is gone (we hold the folder lock)."""
    for f in path.parent.glob(f".{path.name}{CREATING}*"):
        pid = f.name.split(CREATING, 1)[1].split("-")[0]
        alive = pid.isdigit() and int(pid) != os.getpid() and Path(f"/proc/{pid}").exists()
        if not alive:
            f.unlink(missing_ok=True)


def ensure_sqlite_store(path: Path, uri: str) -> Optional[Path]:
    """Make ``path`` hold a complete MLflow store (under the folder lock); returns where a broken one went."""
    _sweep_leftovers(path)
    if not path.exists() or path.stat().st_size == 0:
        _build(path)
        return None
    try:
        state = store_state(path)
    except sqlite3.DatabaseError:
        return None  # not a database at all: MLflow's (and store_check's) own errors name it
    head = _head_revision()
    if state["version"] == head and not state["tmp_tables"]:
        return None
    interrupted = bool(state["tmp_tables"]) or state["version"] is None or "experiments" not in state["tables"]
    if not interrupted:
        return None  # a complete store of another schema version: MLflow says how to upgrade it
    if state["runs"] or state["experiments"] > 1:
        raise HalfMigratedStore(
            f"MLflow store {uri} holds runs but its schema migration was interrupted (alembic version "
            f"{state['version']}, expected {head}; leftover tables {state['tmp_tables'] or 'none'}): nothing was "
            f"changed. Restore a backup of {path}, or drop the _alembic_tmp_* tables (sqlite3 {path} "
            f"'DROP TABLE <name>') and run `mlflow db upgrade {uri}`; or point logger.tracking_uri at a new store")
    aside = path.with_name(f"{path.name}.interrupted-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    os.replace(path, aside)
    log.warning("MLflow store %s was left half-created by an interrupted start (no runs in it): moved to %s and "
                "created again", path, aside)
    _build(path)
    return aside
