"""The multi-process tests' launcher (tests/conftest.py `torchrun`) keeps each worker's log whole.

A worker that fails after writing more than a console tail (6 kB of stderr) shows
must not lose its first lines, the ones that name the error; here a rank writes a marker, 20 kB after it, and
fails: the test failure shows the marker and the rank's full log.
"""
from __future__ import annotations

import pytest

from conftest import torchrun, worker_logs

WORKER = """
import os, sys
rank = int(os.environ["RANK"])
print(f"rank {rank} starts", flush=True)
if rank == 1:
    print("FIRST ERROR LINE of rank 1", file=sys.stderr, flush=True)
    sys.stderr.write("filler line of a long traceback\\n" * 700)
    sys.exit(3)
"""


@pytest.mark.distributed
def test_a_failing_worker_shows_its_whole_log(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    with pytest.raises(pytest.fail.Exception) as failed:
        torchrun(script, [], tmp_path / "logs", cwd=tmp_path, timeout=120)
    msg = str(failed.value)
    assert "FIRST ERROR LINE of rank 1" in msg and msg.count("filler line") == 700
    assert "rank 0 starts" in msg and "rank 1 starts" in msg  # both workers' stdout too
    assert "FIRST ERROR LINE of rank 1" in worker_logs(tmp_path / "logs")


def test_no_worker_log_is_said_plainly(tmp_path):
    assert worker_logs(tmp_path) == f"(no worker log under {tmp_path})"
