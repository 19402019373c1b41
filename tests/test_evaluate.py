"""Evaluation: Avg@k on hand-built engine outputs, checkpoint round trips, and end-to-end runs of
experiments/evaluate.py's `evaluate(cfg)` on the tiny model that check what lands in MLflow.

The end-to-end tests use conf/evaluate.yaml with the random tiny model, MATH500's first 4 problems,
k = 2 and the HF engine; the MLflow store is the session's shared SQLite store (conftest.py).
"""
from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf, open_dict

from fspo.data.base import ListSource, Sample
from fspo.data.math_io import resolve_data_dir
from fspo.evaluation.benchmark import avg_at_k, evaluate_benchmark
from fspo.evaluation.summary import summarize, summary_markdown
from fspo.models.tiny import build_tiny_model, build_tokenizer
from fspo.rewards.base import RewardOutput
from fspo.rewards.math_verify_reward import MathVerifyReward
from fspo.rollout.base import RolloutEngine, SamplingConfig
from fspo.rollout.hf import left_pad
from fspo.runtime.checkpoints.files import (
    find_checkpoints,
    find_run_config,
    load_checkpoint,
    load_into,
    run_id_of_checkpoint,
)
from fspo.types import RolloutBatch

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"
HAVE_DATA = (resolve_data_dir(None) / "math500_test.jsonl").exists()


@pytest.fixture(scope="module")
def mlflow_dir(tmp_path_factory) -> Path:
    """One MLflow SQLite store + artifact folder for this module's runs (creating the schema costs seconds)."""
    return tmp_path_factory.mktemp("eval_mlflow")


@pytest.fixture(scope="module")
def mlflow_uri(mlflow_dir) -> str:
    """``sqlite:///<module tmp>/mlflow.db``."""
    return f"sqlite:///{mlflow_dir / 'mlflow.db'}"


def _load_evaluate_module():
    spec = importlib.util.spec_from_file_location("fspo_evaluate_entry", REPO / "experiments" / "evaluate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def eval_config(overrides, tmp_path, mlflow_uri, mlflow_dir):
    """conf/evaluate.yaml composed with ``overrides``; output and MLflow artifacts under tmp folders."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3", job_name="test_eval"):
        cfg = compose(config_name="evaluate", overrides=list(overrides))
    with open_dict(cfg):
        cfg.output_dir = str(tmp_path / "eval_out")
        cfg.mlflow.tracking_uri = mlflow_uri
        cfg.mlflow.artifact_location = str(mlflow_dir / "eval_artifacts")
    return cfg


class ScriptedEngine(RolloutEngine):
    """Returns fixed completions in order: ``script[k][j]`` is sample j of the k-th prompt it is
    asked about (across calls); a trailing "~" means the sample ran out of tokens (no EOS)."""

    def __init__(self, script):
        self.script, self.pos = script, 0

    def generate(self, prompt_token_ids, params):
        tok, rows = self.tokenizer, []
        for k, prompt in enumerate(prompt_token_ids):
            for j in range(params.n):
                text = self.script[self.pos + k][j]
                ids = tok(text.rstrip("~"), add_special_tokens=False)["input_ids"]
                rows.append((k, prompt, ids if text.endswith("~") else ids + [tok.eos_token_id], text.endswith("~")))
        self.pos += len(prompt_token_ids)
        pi, pm = left_pad([r[1] for r in rows], 0)
        ri, rm = (x.flip(1) for x in left_pad([r[2][::-1] for r in rows], 0))  # right-padded
        return RolloutBatch(prompt_ids=pi, prompt_mask=pm, response_ids=ri, response_mask=rm,
                            group_ids=torch.tensor([r[0] for r in rows]),
                            overlong=torch.tensor([r[3] for r in rows])).validate()


class ParityReward:
    """A test RewardFn: correct iff the completion length is a multiple of 3."""

    def __call__(self, completions, references, lengths, overlong, max_new_tokens):
        ok = [float(len(c) % 3 == 0) for c in completions]
        return RewardOutput(scores=ok, components={"correct": ok, "format": [1.0] * len(ok)})


def test_avg_at_k_formula():
    assert avg_at_k([2, 1, 0], 2) == pytest.approx((1 + 0.5 + 0) / 3)
    assert avg_at_k([2, 1], [2, 4]) == pytest.approx((1 + 0.25) / 2)
    with pytest.raises(ValueError):
        avg_at_k([], 2)


def test_avg_at_k_on_scripted_engine_outputs():
    """3 problems x k = 4 with 4, 1 and 0 correct: Avg@4 = (4/4 + 1/4 + 0/4) / 3 = 5/12."""
    tok = build_tokenizer()
    script = [["so \\boxed{4}", "\\boxed{4}", "Answer: 4", "it is \\boxed{4}."],
              ["\\boxed{7}", "\\boxed{8}", "no idea", "\\boxed{6}~"],
              ["\\boxed{1}", "\\boxed{2}~", "\\boxed{3}~", "nothing"]]
    source = ListSource([Sample(f"Q{i}", a, {"id": f"p{i}"}) for i, a in enumerate(["4", "7 ", "10"])])
    engine = ScriptedEngine([s[:] for s in script])
    engine.setup(None, tok, "")
    res = evaluate_benchmark("toy", source, 4, engine, tok, MathVerifyReward(num_workers=1),
                             SamplingConfig(n=1, max_new_tokens=64), prompts_per_call=2, seed=0)
    assert [p.n_correct for p in res.problems] == [4, 1, 0]
    m = res.metrics()
    assert m["avg_at_k"] == pytest.approx(5 / 12, abs=1e-12)
    assert m["pass_at_k"] == pytest.approx(2 / 3)
    lengths = [len(s.rstrip("~")) + (0 if s.endswith("~") else 1) for s in sum(script, [])]  # 1 char = 1 token
    assert m["response_len_mean"] == pytest.approx(sum(lengths) / 12)
    assert m["overlong_rate"] == pytest.approx(3 / 12)
    assert m["answered_rate"] == pytest.approx(10 / 12)
    assert [p.problem_id for p in res.problems] == ["p0", "p1", "p2"]
    assert res.table()["n_correct"] == [4, 1, 0]


def test_long_prompts_raise_or_skip_and_context_fit():
    tok = build_tokenizer()
    source = ListSource([Sample("short", "1", {"id": "a"}), Sample("x" * 50, "1", {"id": "b"})])
    engine = ScriptedEngine([["\\boxed{1}"], ["\\boxed{1}"]])
    engine.setup(None, tok, "")
    args = ("t", source, 1, engine, tok, ParityReward(), SamplingConfig(n=1, max_new_tokens=100))
    with pytest.raises(ValueError, match="max_prompt_len"):
        evaluate_benchmark(*args, max_prompt_len=10)
    res = evaluate_benchmark(*args, max_prompt_len=10, on_long_prompt="skip", context_len=60)
    assert res.skipped_prompts == 1 and res.max_new_tokens == 55  # 60 - len("short")
    with pytest.raises(ValueError, match="context"):
        evaluate_benchmark(*args, context_len=60, fit_context=False)


def _lightning_ckpt(policy, step: int) -> dict:
    """What RLModule's Lightning checkpoint holds: the module state dict with a ``policy.`` prefix."""
    from fspo.clipping.fspo import FSPOClip
    from fspo.losses import Aggregator
    from fspo.update.module import RLModule
    from fspo.update.settings import PPOConfig

    module = RLModule(policy=policy, clip=FSPOClip(), aggregator=Aggregator(), ppo=PPOConfig(), diagnostics=None)
    sd = module.state_dict()
    sd["rl_step"] = torch.tensor(step)  # RLModule's buffer: RL steps completed
    return {"state_dict": sd, "global_step": 4 * step, "epoch": 0}


def test_checkpoint_round_trip(tmp_path):
    saved, other = build_tiny_model(seed=0), build_tiny_model(seed=1)
    torch.save(_lightning_ckpt(saved, step=7), tmp_path / "epoch=0-step=28.ckpt")
    assert not torch.equal(saved.model.embed_tokens.weight, other.model.embed_tokens.weight)
    state, step = load_checkpoint(tmp_path / "epoch=0-step=28.ckpt")
    load_into(other, state)
    assert step == 7
    for (n1, p1), (n2, p2) in zip(saved.state_dict().items(), other.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2), n1
    with pytest.raises(ValueError, match="does not fit"):
        load_into(other, {"nope": torch.zeros(1)})
    # distributed-checkpoint folder (ModelParallelStrategy) gives the same state
    import torch.distributed.checkpoint as dcp

    dcp.save(_lightning_ckpt(saved, step=9), checkpoint_id=str(tmp_path / "run" / "dcp.ckpt"))
    state2, step2 = load_checkpoint(tmp_path / "run" / "dcp.ckpt")
    assert step2 == 9 and all(torch.equal(state[k], state2[k]) for k in state)
    assert find_checkpoints(tmp_path) == [(tmp_path / "epoch=0-step=28.ckpt").resolve(),
                                          (tmp_path / "run" / "dcp.ckpt").resolve()]
    with pytest.raises(FileNotFoundError):
        find_checkpoints(tmp_path / "missing")


def test_summary_best_last_and_average():
    def entry(name, step, a, b, base=False):
        return {"checkpoint": name, "step": step, "base": base,
                "metrics": {"a": {"avg_at_k": a}, "b": {"avg_at_k": b}}}

    entries = [entry(None, 0, 0.1, 0.0, base=True), entry("s20", 20, 0.5, 0.3), entry("s10", 10, 0.6, 0.3),
               entry("s30", 30, 0.4, 0.2)]
    s = summarize(entries)
    assert s["benchmarks"]["a"]["best"] == {"value": 0.6, "step": 10, "checkpoint": "s10"}
    assert s["benchmarks"]["b"]["best"]["step"] == 10  # tie 0.3 at steps 10 and 20: the earliest
    assert s["benchmarks"]["a"]["last"]["step"] == 30 and s["benchmarks"]["a"]["base"] == 0.1
    assert s["average"]["best"] == pytest.approx((0.6 + 0.3) / 2)  # the paper's: mean of per-benchmark bests
    assert s["average"]["last"] == pytest.approx((0.4 + 0.2) / 2)
    md = summary_markdown(s)
    # 0-1, as MLflow
    assert "| a | 0.1000 | 0.6000 | 10 | 0.4000 | 30 |" in md and "| Average | 0.0500 | 0.4500 |" in md


def test_eval_data_options_carry_the_paper_k(tmp_path, mlflow_uri, mlflow_dir):
    cfg = eval_config(["eval_data=[math500,aime24,aime25,gsm8k]"], tmp_path, mlflow_uri, mlflow_dir)
    assert {n: int(b.samples_per_prompt) for n, b in cfg.eval_data.items()} == \
        {"math500": 8, "aime24": 32, "aime25": 32, "gsm8k": 1}
    assert (cfg.sampling.temperature, cfg.sampling.top_p, cfg.sampling.top_k, cfg.sampling.max_new_tokens) == \
        (0.6, 0.95, 200, 32000)
    big = eval_config(["+model=qwen3_8b", "model.path=/x", "rollout=vllm"], tmp_path, mlflow_uri, mlflow_dir)
    resolved = OmegaConf.to_container(big, resolve=True)
    assert resolved["model"]["hub_id"] == "Qwen/Qwen3-8B-Base" and resolved["model"]["path"] == "/x"
    assert resolved["rollout"]["engine"]["_target_"] == "fspo.rollout.vllm.VLLMEngine"
    assert set(resolved["eval_data"]) == {"math500", "aime24", "aime25"}  # the paper's benchmarks by default


def _artifact_json(client, run_id: str, path: str, dst: Path):
    return json.loads(Path(client.download_artifacts(run_id, path, str(dst))).read_text())


@pytest.mark.skipif(not HAVE_DATA, reason="MATH500 data file not present")
def test_end_to_end_tiny_math500(tmp_path, mlflow_uri, mlflow_dir):
    from mlflow import MlflowClient

    ev = _load_evaluate_module()
    cfg = eval_config(["model.source=random", "eval_data=[math500]", "limit=4", "k=2",
                       "sampling.max_new_tokens=24", "mlflow.experiment_name=test-eval-e2e"],
                      tmp_path, mlflow_uri, mlflow_dir)
    out = ev.evaluate(cfg)
    client = MlflowClient(mlflow_uri)
    run = client.get_run(out["run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["fspo.kind"] == "eval"
    table = _artifact_json(client, out["run_id"], "eval/math500/per_problem.json", tmp_path / "dl")
    rows = [dict(zip(table["columns"], r)) for r in table["data"]]
    assert len(rows) == 4
    assert all(r["k"] == 2 and 0 <= r["n_correct"] <= 2 for r in rows)
    recomputed = sum(r["n_correct"] / r["k"] for r in rows) / len(rows)
    assert run.data.metrics["eval/math500/avg_at_k"] == pytest.approx(recomputed, abs=1e-12)
    assert 0 <= run.data.metrics["eval/math500/overlong_rate"] <= 1
    assert 0 < run.data.metrics["eval/math500/response_len_mean"] <= 24
    assert (Path(cfg.output_dir) / "math500" / "per_problem.json").exists()  # no eval/ inside the eval folder


@pytest.mark.skipif(not HAVE_DATA, reason="MATH500 data file not present")
def test_checkpoints_of_a_run_summary_attached_to_training_run(tmp_path, mlflow_uri, mlflow_dir):
    """A run folder as training leaves it (.hydra/config.yaml, mlflow_run_id, checkpoints/step_N.ckpt):
    the base model and two checkpoints are evaluated into the training run's MLflow run (found from
    the folder): per-step metrics, per-problem tables, the best/last summary and its artifacts."""
    from mlflow import MlflowClient

    run_dir, ckpt_dir = tmp_path / "train_run", tmp_path / "train_run" / "checkpoints"
    (run_dir / ".hydra").mkdir(parents=True)
    ckpt_dir.mkdir()
    OmegaConf.save(OmegaConf.create({"seed": 3, "model": {"name": "tiny", "source": "random", "path": None,
                                                          "hub_id": None, "dtype": "float32"}}),
                   run_dir / ".hydra" / "config.yaml")
    for step, seed in ((4, 10), (8, 11)):
        torch.save(_lightning_ckpt(build_tiny_model(seed=seed), step), ckpt_dir / f"step_{step:06d}.ckpt")
    assert find_run_config(ckpt_dir / "step_000004.ckpt") == run_dir / ".hydra" / "config.yaml"
    client = MlflowClient(mlflow_uri)
    exp = client.get_experiment_by_name("test-eval-train")
    exp_id = exp.experiment_id if exp else client.create_experiment(
        "test-eval-train", artifact_location=str(mlflow_dir / "train_artifacts"))
    train_id = client.create_run(exp_id, run_name="fake-training").info.run_id
    cfg = eval_config([f"checkpoints={run_dir}", "include_base=true", "eval_data=[math500]", "limit=4", "k=2",
                       "sampling.max_new_tokens=16", f"train_run_id={train_id}", "mlflow.attach=true"],
                      tmp_path, mlflow_uri, mlflow_dir)
    with open_dict(cfg):  # a scorer with non-trivial outcomes for the random model
        cfg.reward = OmegaConf.create({"_target_": "test_evaluate.ParityReward"})
    ev = _load_evaluate_module()
    with pytest.raises(FileNotFoundError):  # train_run_id's config: neither a config.yaml artifact nor output_dir
        ev.evaluate(cfg)
    with open_dict(cfg):
        cfg.train_run_id = None
    with pytest.raises(ValueError, match="attach"):  # no run id anywhere
        ev.evaluate(cfg)
    (run_dir / "mlflow_run_id").write_text(train_id + "\n")  # what fspo/runtime/checkpoints/resume.py writes
    assert run_id_of_checkpoint(ckpt_dir / "step_000008.ckpt") == train_id
    assert run_id_of_checkpoint(tmp_path / "x" / ("ab" * 16) / "checkpoints" / "e.ckpt") == "ab" * 16
    out = ev.evaluate(cfg)
    assert out["run_id"] == train_id
    assert [e["step"] for e in out["entries"]] == [0, 4, 8] and out["entries"][0]["base"]
    history = {m.step: m.value for m in client.get_metric_history(train_id, "eval/math500/avg_at_k")}
    assert history == {e["step"]: e["metrics"]["math500"]["avg_at_k"] for e in out["entries"]}
    s = out["summary"]
    ck = {e["step"]: e["metrics"]["math500"]["avg_at_k"] for e in out["entries"][1:]}
    assert s["benchmarks"]["math500"]["last"] == {"value": ck[8], "step": 8,
                                                  "checkpoint": str((ckpt_dir / "step_000008.ckpt").resolve())}
    assert s["benchmarks"]["math500"]["best"]["value"] == max(ck.values())
    assert s["benchmarks"]["math500"]["best"]["step"] == min(st for st, v in ck.items() if v == max(ck.values()))
    logged = _artifact_json(client, train_id, "eval/summary.json", tmp_path / "dl")
    assert logged["benchmarks"]["math500"]["best"]["value"] == max(ck.values())
    for step in (0, 4, 8):
        table = _artifact_json(client, train_id, f"eval/math500/step_{step}/per_problem.json", tmp_path / "dl")
        assert len(table["data"]) == 4
    run = client.get_run(train_id)
    assert run.data.tags["eval/step"] == "8" and run.data.tags["eval/checkpoint"].endswith("step_000008.ckpt")
    assert math.isclose(run.data.metrics["summary/math500/best_avg_at_k"], max(ck.values()))
    assert "summary.md" in [Path(f.path).name for f in client.list_artifacts(train_id, "eval")]
    block = ev.summary_block(cfg, out)  # what evaluate.py ends on: where summary.md went, the run, how to open it
    assert f"  summary:         {(tmp_path / 'eval_out' / 'summary.md').resolve()}" in block.splitlines()
    assert f"experiment:      test-eval-train (id {exp_id})" in block and f"fake-training (id {train_id})" in block
    assert f"mlflow ui --backend-store-uri {mlflow_uri}" in block and "math500/avg_at_k" in block
    # the model config can also come from the run's config.yaml artifact (what train.py logs)
    client.log_artifact(train_id, str(run_dir / ".hydra" / "config.yaml"))
    run_cfg, _ = ev._mlflow_run_config(train_id, mlflow_uri)
    assert run_cfg.model.source == "random" and run_cfg.seed == 3


def test_distributed_checkpoint_reads_the_weights_only(tmp_path, monkeypatch):
    """Evaluation reads the policy's tensors of a sharded checkpoint, never AdamW's state
    (the storage reader is watched: every tensor it is asked for is recorded)."""
    import torch.distributed.checkpoint as dcp

    saved = build_tiny_model(seed=0)
    ckpt = _lightning_ckpt(saved, step=5)
    opt = torch.optim.AdamW(saved.parameters(), lr=1e-3)
    saved(input_ids=torch.tensor([[5, 6, 7]]), labels=torch.tensor([[5, 6, 7]])).loss.backward()
    opt.step()
    ckpt["optimizer_states"] = [opt.state_dict()]  # exp_avg / exp_avg_sq of every parameter
    dcp.save(ckpt, checkpoint_id=str(tmp_path / "dcp.ckpt"))
    asked = []
    original = dcp.FileSystemReader.read_data

    def watched(self, plan, planner):
        asked.extend(item.storage_index.fqn for item in plan.items)
        return original(self, plan, planner)

    monkeypatch.setattr(dcp.FileSystemReader, "read_data", watched)
    state, step = load_checkpoint(tmp_path / "dcp.ckpt")
    assert step == 5
    want = saved.state_dict()
    assert set(state) == set(want) and all(torch.equal(state[k], v) for k, v in want.items())
    assert asked and all(k.startswith("state_dict.policy.") or k == "state_dict.rl_step" for k in asked)
    assert not any("exp_avg" in k or k.startswith("optimizer") for k in asked)
