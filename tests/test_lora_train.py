"""LoRA end to end: kill -9 and resume are exact, the checkpoints hold the adapters only, MLflow gets
the parameter counts and a positive update ratio every step, evaluate.py takes the LoRA checkpoints and
experiments/export_lora.py writes a merged HF model that computes what the LoRA policy computes.

Owns: the LoRA version of tests/test_resume.py's kill/resume test (same functions, same random tiny model
and DigitReward, plus ``model.lora.rank=4``) and the evaluate / export checks on its run folder.
Leaves out: the LoRA math and the bad-input lines (tests/test_lora.py).
"""
from __future__ import annotations

import os
import random
import sqlite3
import time

import pytest
import torch
from test_evaluate import _load_evaluate_module, eval_config
from test_resume import (
    ARGS,
    EVERY,
    NOISY,
    STEPS,
    kill_after_step,
    last_train_step,
    metric_rows,
    policy_state,
    reference_run,
    start_run,
    wait,
)

from conftest import REPO, run_script_in_process
from fspo.runtime.checkpoints.files import list_checkpoints

EXPORT_LORA = REPO / "experiments" / "export_lora.py"
LORA = ["model.lora.rank=4", "model.lora.alpha=8", "model.lora.lr=5e-3"]


@pytest.mark.slow
def test_lora_kill9_resume_evaluate_and_export(tmp_path, mlflow_uri, mlflow_dir):
    seed = int(os.environ.get("FSPO_RESUME_SEED", time.time_ns() % 10_000))
    kill_after = random.Random(seed).randint(EVERY, STEPS - 2)
    why = f"FSPO_RESUME_SEED={seed}: killed after step {kill_after}"
    args = ARGS + LORA
    run = start_run(tmp_path, "killed", args=args)
    db, out = tmp_path / "killed.db", tmp_path / "killed"
    kill_after_step(run, out, db, kill_after, why)
    done = list_checkpoints(out / "checkpoints")
    resumed = start_run(tmp_path, "killed", ["resume=auto"], args=args)
    reference_run(tmp_path, "full", args)  # the uninterrupted run, in this process, meanwhile
    wait(resumed, tmp_path)

    # checkpoints: the adapters (float32) and the module's buffers, no frozen base weight
    final = out / "checkpoints" / f"step_{STEPS:06d}.ckpt"
    a, b = policy_state(tmp_path / "full" / "checkpoints" / f"step_{STEPS:06d}.ckpt"), policy_state(final)
    assert a and all("lora_" in k and v.dtype == torch.float32 for k, v in b.items())
    assert sum(v.numel() for v in b.values()) == 4 * 4 * 2816  # 4 layers x r 4 x 2,816 (tests/test_lora.py)
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert diff <= 1e-6, f"{why}: max |adapter diff| {diff}"
    assert max(float((a[k] - policy_state(done[0])[k]).abs().max()) for k in a) > 1e-3  # it did learn

    # MLflow: same metrics as the uninterrupted run; parameter counts; the adapters moved every step
    rows, ref = metric_rows(db), metric_rows(tmp_path / "full.db")
    got, want = {(k, s): v for _, k, s, v in rows}, {(k, s): v for _, k, s, v in ref}
    assert set(got) == set(want), why
    bad = {p: (got[p], want[p]) for p in want if not p[0].startswith(NOISY)
           and abs(got[p] - want[p]) > 1e-6 * max(1.0, abs(want[p]))}
    assert not bad, f"{why}: metrics differ {dict(list(bad.items())[:10])}"
    assert got[("model/trainable_params", 0)] == 4 * 4 * 2816
    assert got[("model/total_params", 0)] > 4 * got[("model/trainable_params", 0)]
    ratios = {s: v for (k, s), v in got.items() if k == "train/update_ratio"}
    assert sorted(ratios) == list(range(STEPS)) and min(ratios.values()) > 0
    assert last_train_step(db) == STEPS - 1

    # evaluate.py on the run folder: the model rebuilt from the run's config, each LoRA checkpoint loaded
    cfg = eval_config([f"checkpoints={final}", "include_base=true", "eval_data=[arithmetic]", "limit=4", "k=1",
                       "sampling.max_new_tokens=8"], tmp_path, mlflow_uri, mlflow_dir)
    res = _load_evaluate_module().evaluate(cfg)
    assert [e["step"] for e in res["entries"]] == [0, STEPS]

    # export: one command, a plain HF folder whose logits equal the LoRA policy's
    merged_dir = tmp_path / "merged"
    proc = run_script_in_process(EXPORT_LORA, [final, merged_dir])  # the script as `python` runs it, in process
    assert proc.returncode == 0, proc.stderr[-2000:]
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM

    from fspo.models.loading import load_policy
    from fspo.runtime.checkpoints.files import load_checkpoint, load_into

    model_cfg = OmegaConf.to_container(OmegaConf.load(out / "run_config.yaml").model, resolve=True)
    lora, _ = load_policy(**model_cfg, seed=7)
    base_logits_model, _ = load_policy(**{**model_cfg, "lora": None}, seed=7)
    load_into(lora, load_checkpoint(final)[0])
    plain = AutoModelForCausalLM.from_pretrained(merged_dir)
    ids = torch.randint(4, 100, (2, 12))
    with torch.no_grad():
        want_logits = lora(input_ids=ids).logits
        assert torch.allclose(plain(input_ids=ids).logits, want_logits, atol=1e-5)
        assert not torch.allclose(base_logits_model(input_ids=ids).logits, want_logits, atol=1e-4)
    # a full fine-tuning checkpoint is refused with one line
    full_ckpt = tmp_path / "plain.ckpt"
    meta = torch.load(final, weights_only=True)
    meta["fspo_resume"]["run_config"] = meta["fspo_resume"]["run_config"].replace("rank: 4", "rank: 0")
    torch.save(meta, full_ckpt)
    proc = run_script_in_process(EXPORT_LORA, [full_ckpt, tmp_path / "x"])
    assert proc.returncode == 2 and "full fine-tuning checkpoint" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    with sqlite3.connect(db) as con:
        assert con.execute("SELECT count(DISTINCT run_uuid) FROM metrics").fetchone()[0] == 1
