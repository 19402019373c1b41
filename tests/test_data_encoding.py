"""A byte that is not UTF-8 in a math data file (fspo/data/math_io.py).

Owns: such a byte costs its row, not the file: with ``on_bad_row=raise`` the error names the file,
the row, the line and column and the ``data.on_bad_row=skip`` option; with ``skip`` the row is
dropped and counted; the same for a ``.json`` list (the record holding the byte), and through the
Hydra config the entry point prints it as one line. Leaves out: other bad-row kinds (test_math_data.py).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra.utils import instantiate

from conftest import compose_config
from fspo.data.math_datasets import load_math_source
from fspo.data.math_io import DataRowError, read_rows
from fspo.runtime.checks.errors import user_error

ROWS = [{"problem": f"{i}+{i}?", "answer": str(2 * i), "unique_id": f"u{i}"} for i in range(4)]


def write_jsonl_with_bad_byte(path: Path, bad_line: int = 2) -> None:
    lines = [json.dumps(r).encode() for r in ROWS]
    lines[bad_line] = lines[bad_line].replace(b'"problem": "', b'"problem": "\xff', 1)
    path.write_bytes(b"\n".join(lines) + b"\n")


def test_jsonl_bad_byte_names_file_line_and_skip_option(tmp_path):
    write_jsonl_with_bad_byte(tmp_path / "math500_test.jsonl")
    with pytest.raises(DataRowError) as e:
        load_math_source("math500", data_dir=str(tmp_path))
    msg = str(e.value)
    assert "math500_test.jsonl row 2" in msg and "not UTF-8 (0xff at line 3, column 14)" in msg, msg
    assert "data.on_bad_row=skip" in msg


def test_jsonl_bad_byte_is_skipped(tmp_path, caplog):
    write_jsonl_with_bad_byte(tmp_path / "math500_test.jsonl")
    src = load_math_source("math500", data_dir=str(tmp_path), on_bad_row="skip")
    assert [s.answer for s in src] == ["0", "2", "6"] and src.stats == {"skipped": 1, "rows_read": 4}
    assert "skipped 1 bad row(s) of 4" in caplog.text


def test_json_list_bad_byte_costs_its_record(tmp_path):
    text = json.dumps([{"problem": "1+1?", "answer": 2}, {"problem": "2+2?", "answer": 4}], indent=1).encode()
    (tmp_path / "aime_1983_2023.json").write_bytes(text.replace(b'"2+2?', b'"2+\xfe2?'))
    rows = read_rows(tmp_path / "aime_1983_2023.json")
    assert rows[0] == (0, {"problem": "1+1?", "answer": 2})
    assert "not UTF-8 (the file's first: 0xfe at line 7, column 17)" in str(rows[1][1])


def test_json_broken_structure_names_the_file(tmp_path):
    (tmp_path / "aime_1983_2023.json").write_bytes(b'[{"problem": \xff}]')
    with pytest.raises(ValueError, match=r"aime_1983_2023\.json: not valid JSON .* at line 1, column 14"):
        read_rows(tmp_path / "aime_1983_2023.json")


def test_entry_point_line_through_the_config(tmp_path):
    write_jsonl_with_bad_byte(tmp_path / "math500_test.jsonl")
    cfg = compose_config(["data=math_train", f"data.data_dir={tmp_path}", "val.size=2"])
    with pytest.raises(Exception) as e:
        instantiate(cfg.data.val)
    line = user_error(e.value)  # what experiments/run.py prints after "error: "
    assert "\n" not in line and "math500_test.jsonl" in line and "line 3" in line and "on_bad_row=skip" in line
    cfg = compose_config(["data=math_train", f"data.data_dir={tmp_path}", "val.size=2", "data.on_bad_row=skip"])
    assert len(instantiate(cfg.data.val)) == 2
