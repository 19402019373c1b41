"""Math data: templates, loaders on the real files, de-duplication, bad rows, configs."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pandas as pd
import pytest

from fspo.data.dedup import Record, merge_deduplicated, normalize_problem
from fspo.data.math_datasets import EVAL_SETS, FILES, load_math_source
from fspo.data.math_io import PROJECT_ROOT, DataRowError, resolve_data_dir
from fspo.data.templates import BOXED_INSTRUCTION, render

CONF = PROJECT_ROOT / "conf"
DATA = resolve_data_dir(None)
needs_data = pytest.mark.skipif(
    not all((DATA / f.filename).is_file() for f in FILES.values()),
    reason=f"math data files not found in {DATA} (set FSPO_DATA_DIR or provide ../shared/data)")


# ---------------------------------------------------------------- templates
def test_templates_render_exact_strings():
    assert render("raw", "What is $1+1$?") == "What is $1+1$?"
    assert render("boxed", "P") == "P\nPlease reason step by step, and put your final answer within \\boxed{}."
    dapo = render("dapo", "P")
    assert dapo.startswith("Solve the following math problem step by step. The last line of your response")
    assert "\n\nP\n\nRemember to put your answer on its own line after \"Answer:\"." in dapo
    assert render("Q: {problem} {x}", "a{b}") == "Q: a{b} {x}"  # custom string; other braces untouched


def test_unknown_template_lists_choices():
    with pytest.raises(ValueError, match="unknown prompt template 'chat'.*boxed.*dapo.*raw"):
        render("chat", "P")
    with pytest.raises(ValueError, match="unknown prompt template"):
        load_math_source("math500", template="nope")


# ---------------------------------------------------------------- real files
@needs_data
def test_eval_sets_rows_and_references():
    m = load_math_source("math500")
    assert len(m) == 500 and m[0].answer == "\\left( 3, \\frac{\\pi}{2} \\right)"
    assert m[0].meta == {"source": "math500", "row": 0, "id": "test/precalculus/807.json"}
    assert m[0].prompt.endswith("\n" + BOXED_INSTRUCTION)
    a24 = load_math_source("aime24", template="raw")
    assert len(a24) == 30 and all(s.answer.isdigit() and not s.answer.startswith("0") for s in a24)
    assert a24[7].answer == "25"  # stored as "025": compared as an integer
    a25 = load_math_source("aime25", template="raw")
    assert len(a25) == 30 and a25[0].answer == "70"
    assert a25[0].prompt == "Find the sum of all integer bases $b>9$ for which $17_b$ is a divisor of $97_b.$"
    assert not any("Please reason" in s.prompt for s in a25)
    g = load_math_source("gsm8k", template="raw")
    assert len(g) == 1319 and g[0].answer == "18"
    assert all("," not in s.answer for s in g) and "2125" in {s.answer for s in g}  # "2,125"


@needs_data
@pytest.mark.slow  # > 2.5 s: out of the quick loop (-m "not slow"), still in CI
def test_train_set_dedup_counts():
    t = load_math_source("dapo_aime_train")
    d = t.stats["dedup"]
    # 17,917 DAPO rows, 1,348 exact duplicates after normalisation; of 975 AIME problems 694 equal a
    # DAPO prompt after normalisation and 130 more are near duplicates -> 151 AIME problems kept.
    got = (t.stats["rows_read"], d["primary_exact"], d["secondary_exact"], d["secondary_near"])
    assert got == (18892, 1348, 694, 130)
    assert len(t) == d["kept"] == 16720
    assert sum(s.meta["source"] == "aime_1983_2023" for s in t) == 151
    keys = [normalize_problem(s.prompt) for s in t]
    assert len(set(keys)) == len(keys)
    assert len(load_math_source("dapo_aime_train", dedup=False)) == 18892


@needs_data
def test_limit_shuffle_seed():
    first = load_math_source("math500", limit=5)
    assert [s.meta["row"] for s in first] == [0, 1, 2, 3, 4]
    a = [s.meta["row"] for s in load_math_source("math500", limit=20, shuffle=True, seed=1)]
    b = [s.meta["row"] for s in load_math_source("math500", limit=20, shuffle=True, seed=1)]
    c = [s.meta["row"] for s in load_math_source("math500", limit=20, shuffle=True, seed=2)]
    assert a == b and a != c and a != list(range(20))


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown math dataset 'math5000'"):
        load_math_source("math5000")
    with pytest.raises(ValueError, match="only the split 'test'"):
        load_math_source("math500", split="train")
    with pytest.raises(ValueError, match="limit must be a positive integer"):
        load_math_source("math500", limit=0)
    with pytest.raises(ValueError, match="on_bad_row must be one of"):
        load_math_source("aime25", data_dir="/nonexistent", on_bad_row="ignore")  # checked before any file


# ---------------------------------------------------------------- normalisation / dedup units
def test_normalize_problem_keeps_operators_drops_typesetting():
    assert normalize_problem("Find $x+y$.") != normalize_problem("Find $x-y$.")
    assert normalize_problem("If $k^{}_{}$ is \\dfrac{1}{2}") == normalize_problem("if  $k$ is \\frac{1}{2}")
    assert normalize_problem("\\[ \\left( a \\right) \\]\\quad b") == normalize_problem("(a) b")


def test_near_duplicates_need_high_containment_or_same_answer():
    base = "Let a triangle have sides 13 14 15 and let the incircle touch side BC at D. Find BD times DC."
    primary = [Record(base + " Express the answer as an integer.", "42", {}),
               Record("Unrelated counting problem about 7 coins.", "3", {})]
    secondary = [Record(base, "42", {}),                                     # contained -> near duplicate
                 Record("A completely different geometry question about circles.", "42", {}),
                 Record("Unrelated counting problem about 7 coins.", "3", {})]  # exact duplicate
    kept, st = merge_deduplicated(primary, secondary)
    assert (st.primary_exact, st.secondary_exact, st.secondary_near, st.kept) == (0, 1, 1, 3)
    assert kept[-1].problem.startswith("A completely different")


# ---------------------------------------------------------------- bad rows
def _jsonl(path: Path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


def test_bad_jsonl_rows_raise_or_skip(tmp_path, caplog):
    _jsonl(tmp_path / "math500_test.jsonl", [
        {"problem": "1+1?", "answer": "2", "unique_id": "a"},
        {"problem": "2+2?", "unique_id": "b"},                # row 1: answer missing
        {"problem": "   ", "answer": "3"},                    # row 2: problem empty
        "{not json",                                          # row 3: invalid JSON
        {"problem": "3+3?", "answer": 6},                     # ints are accepted as answers
        {"problem": ["x"], "answer": "1"},                    # row 5: problem not a string
    ])
    with pytest.raises(DataRowError, match=r"math500_test\.jsonl row 1: field 'answer' is missing"):
        load_math_source("math500", data_dir=str(tmp_path))
    src = load_math_source("math500", data_dir=str(tmp_path), on_bad_row="skip")
    assert [s.answer for s in src] == ["2", "6"] and src.stats["skipped"] == 4
    assert "skipped 4 bad row(s) of 6" in caplog.text


def test_bad_gsm8k_and_aime25_rows(tmp_path):
    _jsonl(tmp_path / "gsm8k_test.jsonl",
           [{"question": "q", "answer": "work\n#### 1,234"}, {"question": "q2", "answer": "no marker"}])
    with pytest.raises(DataRowError, match=r"gsm8k_test\.jsonl row 1: field 'answer' has no final answer"):
        load_math_source("gsm8k", data_dir=str(tmp_path))
    assert load_math_source("gsm8k", data_dir=str(tmp_path), on_bad_row="skip")[0].answer == "1234"
    _jsonl(tmp_path / "aime2025_test.jsonl", [{"prompt": "P\n" + BOXED_INSTRUCTION, "answer": True}])
    with pytest.raises(DataRowError, match=r"row 0: field 'answer' must be a string, got bool"):
        load_math_source("aime25", data_dir=str(tmp_path))


def _dapo_row(content, gt, idx):
    return {"data_source": "DAPO-17k", "prompt": [{"content": content, "role": "user"}], "ability": "math",
            "reward_model": {"ground_truth": gt, "style": "rule"},
            "extra_info": {"answer": "", "index": idx, "split": "train"}}


def test_bad_parquet_rows_and_training_merge(tmp_path):
    rows = [_dapo_row("Find 1+1.", "2", 0), _dapo_row("Find 2+3.", "", 1), _dapo_row("Find   1+1.", "2", 2),
            _dapo_row("", "4", 3)]
    pd.DataFrame(rows).to_parquet(tmp_path / "dapo_math_17k.parquet")
    (tmp_path / "aime_1983_2023.json").write_text(json.dumps([
        {"problem": "Find $1+1$.", "answer": "002", "year": 1983, "aime_number": 1, "problem_number": 1},
        {"problem": "Find 7*6.", "answer": "042", "year": 1983, "aime_number": 1, "problem_number": 2}]))
    with pytest.raises(DataRowError,
                       match=r"dapo_math_17k\.parquet row 1: field 'reward_model\.ground_truth' is empty"):
        load_math_source("dapo_aime_train", data_dir=str(tmp_path))
    src = load_math_source("dapo_aime_train", data_dir=str(tmp_path), on_bad_row="skip", template="raw")
    assert [(s.prompt, s.answer) for s in src] == [("Find 1+1.", "2"), ("Find 7*6.", "42")]
    assert src.stats["skipped"] == 2 and src.stats["dedup"]["primary_exact"] == 1
    assert src.stats["dedup"]["secondary_exact"] == 1
    assert src[1].meta == {"source": "aime_1983_2023", "row": 1, "id": "aime-1983-1-2"}


# ---------------------------------------------------------------- data directory and hub fallback
def test_missing_file_error_names_file_and_setting(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # "not installed"
    with pytest.raises(FileNotFoundError, match=r"'aime2024_test\.jsonl' not found.*data\.data_dir.*FSPO_DATA_DIR"):
        load_math_source("aime24", data_dir=str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"math500_test\.jsonl.*hub fallback 'HuggingFaceH4/MATH-500' failed"):
        load_math_source("math500", data_dir=str(tmp_path))


def test_hub_fallback_used_only_when_file_absent(tmp_path, monkeypatch):
    calls = []

    def load_dataset(hub_id, config, split):
        calls.append((hub_id, config, split))
        return [{"question": "How many?", "answer": "steps\n#### 1,000"}]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    src = load_math_source("gsm8k", data_dir=str(tmp_path))
    assert calls == [("openai/gsm8k", "main", "test")] and src[0].answer == "1000"


def test_resolve_data_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("FSPO_DATA_DIR", raising=False)
    assert resolve_data_dir(None) == (PROJECT_ROOT / "../shared/data").resolve()
    assert resolve_data_dir("data_x") == PROJECT_ROOT / "data_x"
    monkeypatch.setenv("FSPO_DATA_DIR", str(tmp_path))
    assert resolve_data_dir(None) == tmp_path and resolve_data_dir("/abs") == Path("/abs")


# ---------------------------------------------------------------- configs
@needs_data
def test_configs_compose_and_instantiate():
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(overrides=["+data=math_train", "+reward=math_verify", "+eval_data=[math500,aime24,aime25,gsm8k]",
                                 "+val.size=4"])
    assert len(instantiate(cfg.data.val)) == 4 and cfg.data.max_prompt_len >= 2000
    assert set(cfg.eval_data) == set(EVAL_SETS)
    assert (cfg.eval_data.math500.samples_per_prompt, cfg.eval_data.aime24.samples_per_prompt) == (8, 32)
    for name in EVAL_SETS:
        assert instantiate(cfg.eval_data[name].source, limit=2).name == name
    reward = instantiate(cfg.reward)
    assert reward.overlong_buffer_len == 0 and reward.pool.timeout_s == 1.0


@needs_data
@pytest.mark.skipif(not (CONF / "config.yaml").is_file(), reason="no root config yet")
def test_math_configs_compose_with_the_root_config():
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["data=math_train", "reward=math_verify", "val.size=3"])
    OmegaConf.resolve(cfg)  # every interpolation the root config makes into data/ resolves
    assert len(instantiate(cfg.data.val)) == 3
    assert type(instantiate(cfg.reward)).__name__ == "MathVerifyReward"


@needs_data
def test_relative_data_dir_survives_hydra_chdir(tmp_path):
    app = tmp_path / "app.py"
    app.write_text(textwrap.dedent(f"""
        import hydra
        from hydra.utils import instantiate

        @hydra.main(config_path={str(CONF)!r}, config_name=None, version_base="1.3")
        def main(cfg):
            src = instantiate(cfg.data.val)
            print("OK", len(src), src[0].meta["source"])

        main()
    """))
    out = subprocess.run([sys.executable, str(app), "+data=math_train", "+val.size=2", "hydra.job.chdir=true",
                          f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, capture_output=True, text=True,
                         env={k: v for k, v in __import__("os").environ.items() if k != "FSPO_DATA_DIR"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert "OK 2 math500" in out.stdout
