"""A hub model id without network fails in seconds (fspo/models/loading.py).

Owns: ``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE`` are honoured without contacting the hub; without
them the hub is probed once and, when it does not answer, only the local cache is read (no rounds of
retries); the error names the hub id and ``model.path``. "No network" is made by pointing
``HF_ENDPOINT`` at a closed local port (so the test never downloads, with or without internet).
Leaves out: loading from a local folder (test_bad_input.py, test_config_compose.py).
"""
from __future__ import annotations

import os
import shutil
import socket
import sys
import time
from pathlib import Path

import pytest

from conftest import free_port
from fspo.models import loading
from fspo.models.loading import ModelNotFoundError, load_policy

HUB_ID = "fspo-test/no-such-model"


@pytest.mark.parametrize("var", ["HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"])
def test_offline_variables_are_honoured_without_a_probe(var, monkeypatch):
    for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv(var, "1")
    monkeypatch.setattr(socket, "create_connection", lambda *a, **k: pytest.fail("probed the hub while offline"))
    assert loading._offline_reason() == f"{var}=1"


def test_unreachable_hub_is_probed_once_and_fails_in_seconds(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")  # closed: no network
    probes = []
    real = socket.create_connection

    def counted(*a, **k):
        probes.append(a[0])
        return real(*a, **k)

    monkeypatch.setattr(loading.socket, "create_connection", counted)
    t0 = time.monotonic()
    with pytest.raises(ModelNotFoundError) as e:
        load_policy(source="pretrained", hub_id=HUB_ID)
    took = time.monotonic() - t0
    assert took < 10, f"{took:.1f} s (before: 2 rounds of 5 hub retries, ~46 s)"
    assert len(probes) == 1
    msg = str(e.value)
    assert HUB_ID in msg and "model.path" in msg and "unreachable" in msg and "\n" not in msg, msg
    assert f"`hf download {HUB_ID} --local-dir" in msg  # the CLI huggingface_hub >= 1.0 installs
    assert shutil.which("hf", path=str(Path(sys.executable).parent)) is not None


@pytest.mark.slow  # a full import of the stack: 10-35 s on a loaded 2-core machine
def test_entry_point_without_network_is_fast(tmp_path_factory):
    """+model=qwen3_8b through experiments/run.py, HF_HUB_OFFLINE=0 (was 57 s after the imports); the seconds
    after the imports are measured by conftest's `run_py_cases` driver."""
    from test_bad_input import NO_PLAN, NOT_MODEL, single_error_line

    from conftest import run_py_cases

    env = {k: v for k, v in os.environ.items() if k not in ("HYDRA_FULL_ERROR", "FSPO_DATA_DIR")}
    env.update(HF_HUB_OFFLINE="0", HF_ENDPOINT=f"http://127.0.0.1:{free_port()}", PYTHONWARNINGS="ignore",
               HF_HOME=str(tmp_path_factory.getbasetemp() / "hf_online"))

    def cases(folder):
        return {"online": ([*NOT_MODEL, *NO_PLAN, "+model=qwen3_8b", f"hydra.run.dir={folder / 'online' / 'h'}"],
                           {"MLFLOW_TRACKING_URI": f"sqlite:///{folder / 'online' / 'm.db'}"})}

    proc, elapsed, _ = run_py_cases(tmp_path_factory, "hub_online", cases, env)("online")
    line = single_error_line(proc)
    assert "Qwen/Qwen3-8B-Base" in line and "model.path" in line, line
    assert elapsed < 15, f"took {elapsed:.0f} s after the imports"
