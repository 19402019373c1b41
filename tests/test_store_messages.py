"""Full and read-only stores: one line, and a fix whose keys exist.

Owns: MLflow's logged traceback of a full SQLite store is dropped from the console (the error is raised on and
reported as one line; other SQL errors are still logged), and a read-only artifact folder's message names
overrides that the config accepts (``+logger.artifact_location`` with a new ``logger.experiment_name``: an
experiment keeps the folder it was created with). Leaves out: the full-disk checks themselves
(test_store_check.py).
"""
from __future__ import annotations

import errno
import logging
import sqlite3
from pathlib import Path

import pytest
from sqlalchemy.exc import IntegrityError, OperationalError

from conftest import compose_config
from fspo.runtime.checks import store_check
from fspo.runtime.checks.console import quiet_third_party
from fspo.runtime.checks.store_check import StoreError, prepare_store


def test_mlflow_s_traceback_of_a_full_store_is_not_printed(caplog):
    quiet_third_party()
    log = logging.getLogger("mlflow.store.db.utils")
    full = OperationalError("INSERT INTO metrics", {}, sqlite3.OperationalError("database or disk is full"))
    other = IntegrityError("INSERT INTO metrics", {}, sqlite3.IntegrityError("UNIQUE constraint failed"))
    with caplog.at_level(logging.ERROR, logger="mlflow.store.db.utils"):
        for exc in (full, other):
            try:
                raise exc
            except Exception:  # noqa: BLE001 - logged as MLflow does
                log.exception("SQLAlchemy database error. The following exception is caught.")
    assert [r.exc_info[1] for r in caplog.records] == [other]


def test_a_read_only_artifact_folder_names_overrides_that_exist(tmp_path, monkeypatch):
    art = tmp_path / "art"
    real = store_check._write_probe

    def probe(path: Path):
        if art in Path(path).parents or Path(path).parent == tmp_path:
            raise OSError(errno.EROFS, "Read-only file system")
        return real(path)

    monkeypatch.setattr(store_check, "_write_probe", probe)
    (tmp_path / "db").mkdir()
    with pytest.raises(StoreError) as e:
        prepare_store(f"sqlite:///{tmp_path / 'db' / 'm.db'}", "exp", str(art))
    msg = str(e.value)
    assert "read-only file system" in msg and "+logger.artifact_location=" in msg and "logger.experiment_name=" in msg
    compose_config(["logger.experiment_name=new", f"+logger.artifact_location={tmp_path}"])  # what it says works
