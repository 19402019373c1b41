"""Entry point: evaluate a policy on benchmarks (Avg@k), any checkpoint, any engine.

    python experiments/evaluate.py checkpoints=outputs/2026-11-22/10-00-00          # every *.ckpt of a run
    python experiments/evaluate.py checkpoints=<default run's output_dir> include_base=true  # built-in task's set
    python experiments/evaluate.py checkpoints='runs/*/checkpoints/*.ckpt' include_base=true
    python experiments/evaluate.py train_run_id=<mlflow run id> mlflow.attach=true  # log into the training run
    python experiments/evaluate.py +model=qwen3_8b model.path=/data/Qwen3-8B-Base rollout=vllm
    python experiments/evaluate.py model.source=random eval_data=[math500] limit=4 k=2 sampling.max_new_tokens=32

Config: conf/evaluate.yaml (decoding per the paper's test-time table; benchmarks from conf/eval_data/). The model
config is the training run's own ``model`` node when one is found; a run on the built-in task gets its held-out
set (fspo/evaluation/eval_sets.py). Every benchmark's longest prompt is checked against the context before any
MLflow run; a bad setting or input ends with one line naming the problem (exit code 2); SIGTERM/Ctrl-C end the
run KILLED.
"""
from __future__ import annotations

import logging
import os
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any, Dict, List, Optional

import hydra
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf, open_dict

from fspo.cli import normalize_group_overrides, unknown_key_error  # also the help template's resolver
from fspo.runtime.checks.errors import user_error

log = logging.getLogger("evaluate")


def _mlflow_run_config(rid: str, uri: str) -> tuple[DictConfig, Path]:
    """(config, run folder) of MLflow run ``rid``: its ``config.yaml`` artifact (logged at the end
    of training), else ``<output_dir param>/.hydra/config.yaml`` (a run still going)."""
    from mlflow import MlflowClient
    from mlflow.artifacts import download_artifacts

    from fspo.runtime.checkpoints.files import find_run_config, read_config_file

    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    params = MlflowClient(uri).get_run(rid).data.params
    with tempfile.TemporaryDirectory() as tmp:
        try:
            run_cfg = OmegaConf.load(download_artifacts(run_id=rid, artifact_path="config.yaml", dst_path=tmp,
                                                        tracking_uri=uri))
        except Exception:  # noqa: BLE001 - no artifact yet: fall back to the run folder
            run_cfg = None
    out = (run_cfg.get("output_dir") if run_cfg is not None else None) or params.get("output_dir")
    run_dir = Path(str(out)) if out and out != "None" else None
    if run_cfg is None:
        path = find_run_config(run_dir) if run_dir is not None else None
        if path is None:
            raise FileNotFoundError(f"MLflow run {rid} has no config.yaml artifact and its output_dir "
                                    f"({run_dir}) holds no .hydra/config.yaml: pass checkpoints=... and model.*")
        run_cfg = read_config_file(path)
    return run_cfg, run_dir


def _training_run(cfg: DictConfig) -> tuple[Optional[DictConfig], List[Path], Optional[str]]:
    """(training run config or None, checkpoints to evaluate, training run id or None): the config of
    ``train_run_id``, else the one above the first checkpoint, else that of the MLflow run named by its folder."""
    from mlflow import MlflowClient

    from fspo.runtime.checkpoints.files import find_checkpoints, find_run_config, read_config_file, run_id_of_checkpoint
    from fspo.runtime.checkpoints.stored_config import check_stored_targets

    uri, rid = str(cfg.mlflow.tracking_uri), cfg.train_run_id
    run_cfg, run_dir = _mlflow_run_config(str(rid), uri) if rid else (None, None)
    spec = cfg.checkpoints if cfg.checkpoints is not None else (str(run_dir) if run_dir is not None else None)
    ckpts = find_checkpoints(OmegaConf.to_container(spec) if OmegaConf.is_list(spec) else spec) if spec else []
    if ckpts and run_cfg is None:
        path = find_run_config(ckpts[0])
        if path is not None:
            run_cfg = read_config_file(path)
        rid = run_id_of_checkpoint(ckpts[0])
        try:  # the run id in the path counts only if this tracking store knows that run
            if rid is not None and path is None:
                run_cfg, _ = _mlflow_run_config(rid, uri)
            elif rid is not None:
                MlflowClient(uri).get_run(rid)
        except Exception as e:  # noqa: BLE001 - another store, or no config: fall back to model.*
            log.info("MLflow run %s (from the checkpoint path) not usable in %s: %s", rid, uri, e)
            rid = None
        log.info("training run config: %s", path or (f"MLflow run {rid}" if run_cfg is not None else "not found"))
    if run_cfg is not None:  # read from a file: only allow-listed _target_s in what evaluate builds from it
        check_stored_targets(run_cfg, "the training run's config", trusted=cfg,
                             keys=("data", "model"))  # (fspo/runtime/checkpoints/stored_config.py)
    return run_cfg, ckpts, (str(rid) if rid else None)


def evaluate(cfg: DictConfig) -> Dict[str, Any]:
    """Run the evaluation described by ``cfg`` (conf/evaluate.yaml); returns ``{"run_id", "entries",
    "summary"}`` where each entry is ``{"checkpoint", "step", "base", "metrics": {benchmark: {...}}}``."""
    from dataclasses import replace

    import torch

    from fspo.evaluation.benchmark import check_fits_context, context_length, duration, evaluate_benchmark
    from fspo.evaluation.eval_sets import build_benchmarks, select_eval_data
    from fspo.evaluation.summary import MlflowRecorder, summarize
    from fspo.models.loading import load_policy
    from fspo.rollout.base import SamplingConfig
    from fspo.rollout.hf import HFEngine
    from fspo.runtime.checkpoints.files import load_checkpoint, load_into
    from fspo.tracking.artifacts import flatten_params
    from fspo.tracking.logger import check_tracking_uri

    # an http(s) tracking server must answer now (<= 2 x 5 s), not after MLflow's minutes of retries
    check_tracking_uri(str(cfg.mlflow.tracking_uri), key="mlflow.tracking_uri", fallback=False)
    out_dir = Path(cfg.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    run_cfg, ckpts, train_run_id = _training_run(cfg)
    m = cfg.mlflow
    if m.attach and not train_run_id:
        raise ValueError("mlflow.attach=true needs the training run: set train_run_id=<MLflow run id>")
    select_eval_data(cfg, run_cfg)  # a run on the built-in task: its held-out evaluation set
    benchmarks = build_benchmarks(cfg)  # data problems surface before any model is loaded
    if run_cfg is None and ckpts and cfg.use_run_model:
        log.warning("no training run config found for %s: building the model from model.* here", ckpts[0])
    from_run = run_cfg is not None and bool(cfg.use_run_model)
    model_kw = OmegaConf.to_container(run_cfg.model if from_run else cfg.model, resolve=True)
    policy, tokenizer = load_policy(**model_kw, seed=int(run_cfg.get("seed", cfg.seed) if from_run else cfg.seed))
    engine = instantiate(cfg.rollout.engine)
    s = cfg.sampling
    sampling = SamplingConfig(n=1, temperature=float(s.temperature), top_p=float(s.top_p), top_k=int(s.top_k),
                              max_new_tokens=int(s.max_new_tokens))
    context_len = context_length(policy, engine)
    for name, b in benchmarks.items():  # before any MLflow run
        check_fits_context(name, b.source, tokenizer, b.max_new_tokens or sampling.max_new_tokens, context_len,
                           max_prompt_len=cfg.max_prompt_len, on_long_prompt=str(cfg.on_long_prompt),
                           fit_context=bool(cfg.fit_context))
    device = str(cfg.device)
    if device == "auto":  # vLLM keeps its own copy on the GPU: the policy is only a weight source there
        device = "cuda" if torch.cuda.is_available() and isinstance(engine, HFEngine) else "cpu"
    policy.to(device).eval()
    (out_dir / "engine").mkdir(exist_ok=True)
    engine.setup(policy, tokenizer, str(out_dir / "engine"))
    reward_fn = instantiate(cfg.reward)
    rewards = {name: instantiate(b.reward) if b.reward else reward_fn for name, b in benchmarks.items()}
    tags = {"fspo.kind": "eval", "eval/model": model_kw.get("name"), "eval/train_run_id": train_run_id,
            **dict(m.tags or {})}
    run_name = m.run_name or _eval_run_name(str(m.tracking_uri), train_run_id, ckpts)
    if train_run_id and not m.attach:  # linked in the eval run's description
        tags.setdefault("mlflow.note.content", f"Evaluation of training run {run_name[len('eval-'):]} "
                                               f"(id {train_run_id}).")
    recorder = MlflowRecorder(str(m.tracking_uri), out_dir, experiment_name=str(m.experiment_name),
                              run_id=train_run_id if m.attach else None,
                              run_name=run_name, tags=tags, artifact_location=m.artifact_location)
    recorder.log_params(flatten_params(OmegaConf.to_container(cfg, resolve=True)))
    recorder.log_json(OmegaConf.to_container(cfg, resolve=True), "eval/evaluate_config.json")
    targets: List[Optional[Path]] = ([None] if cfg.include_base or not ckpts else []) + list(ckpts)
    entries, seen, ok, stopped = [], set(), False, None
    t_all = time.perf_counter()
    sizes = ", ".join(f"{n} ({len(b.source)} problems x {b.k})" for n, b in benchmarks.items())
    try:
        for i, target in enumerate(targets):
            label = f"[{i + 1}/{len(targets)} {'base model' if target is None else Path(target).name}]"
            log.info("%s evaluating on %s", label, sizes)
            step = 0 if target is None and ckpts else None
            if target is not None:
                state, step = load_checkpoint(target)
                if step is not None and step in seen:
                    log.info("skipping %s: step %s already evaluated", target, step)
                    continue
                load_into(policy, state)
                del state
            seen.add(step)
            engine.sync_weights(policy)
            metrics = {}
            for name, b in benchmarks.items():
                k = b.k
                res = evaluate_benchmark(
                    name, b.source, k, engine, tokenizer, rewards[name],
                    replace(sampling, max_new_tokens=b.max_new_tokens or sampling.max_new_tokens),
                    context_len=context_length(policy, engine), max_prompt_len=cfg.max_prompt_len,
                    on_long_prompt=str(cfg.on_long_prompt), fit_context=bool(cfg.fit_context),
                    prompts_per_call=cfg.prompts_per_call or (max(1, engine.batch_size // k) if isinstance(
                        engine, HFEngine) else None), keep_completions=bool(cfg.save_completions),
                    seed=(int(cfg.seed) * 1_000_003 + zlib.crc32(name.encode())) % 2**31, label=label)
                folder = f"eval/{name}" + ("" if step is None else f"/step_{step}")
                metrics[name] = recorder.log_benchmark(res, step, str(target) if target else None, folder)
                log.info("%s %s: Avg@%d = %.4f (%s)", target or "model", name, k, metrics[name]["avg_at_k"],
                         {x: round(v, 4) for x, v in metrics[name].items() if x != "avg_at_k"})
            mean = sum(v["avg_at_k"] for v in metrics.values()) / len(metrics)
            recorder.log_metrics({"eval/average/avg_at_k": mean}, step or 0)
            entries.append({"checkpoint": str(target) if target else None, "step": step,
                            "base": target is None and bool(ckpts), "metrics": metrics})
            spent, left = time.perf_counter() - t_all, len(targets) - i - 1
            if left:
                log.info("%s done; %s so far, ETA %s for the %d left", label, duration(spent),
                         duration(spent / (i + 1) * left), left)
        summary = summarize(entries) if ckpts else None
        if summary is not None:
            recorder.log_summary(summary)
        ok = True
    except (SystemExit, KeyboardInterrupt):  # a stop signal or Ctrl-C (fspo/runtime/checkpoints/stop_signal.py)
        stopped = "KILLED"
        raise
    finally:
        recorder.close(ok, status=stopped)
        for fn in {id(f): f for f in [reward_fn, *rewards.values()]}.values():
            if hasattr(fn, "close"):
                fn.close()
    return {"run_id": recorder.run_id, "entries": entries, "summary": summary}


def summary_block(cfg: DictConfig, result: Dict[str, Any]) -> str:
    """The end-of-evaluation block: output dir, where ``summary.md`` went, the MLflow run and how to open it."""
    from fspo.tracking.run_summary import eval_summary

    uri, rid = str(cfg.mlflow.tracking_uri), result.get("run_id")
    exp_name, exp_id, run_name = str(cfg.mlflow.experiment_name), None, cfg.mlflow.run_name
    try:
        from mlflow import MlflowClient

        client = MlflowClient(uri)
        info = client.get_run(rid).info
        exp_id, run_name = info.experiment_id, info.run_name
        exp_name = client.get_experiment(exp_id).name
    except Exception as e:  # noqa: BLE001 - the block never fails a finished evaluation
        log.debug("evaluation summary: MLflow lookup failed: %s", e)
    return eval_summary(cfg.output_dir, uri, exp_name, exp_id, run_name, rid, result.get("entries"),
                        Path(cfg.output_dir) / "summary.md")


def _eval_run_name(uri: str, train_run_id: Optional[str], ckpts: List[Path]) -> Optional[str]:
    """``eval-<training run name>`` (from MLflow), else ``eval-<run folder name>``, else None (MLflow's)."""
    if train_run_id:
        try:
            from mlflow import MlflowClient

            return f"eval-{MlflowClient(uri).get_run(train_run_id).info.run_name}"
        except Exception as e:  # noqa: BLE001 - a name is never worth failing an evaluation
            log.debug("training run name: %s", e)
    if ckpts:
        run = ckpts[0].parent.parent if ckpts[0].parent.name == "checkpoints" else ckpts[0].parent
        return f"eval-{run.name}"
    return None


@hydra.main(config_path="../conf", config_name="evaluate", version_base="1.3")
def main(cfg: DictConfig):
    """Hydra entry point; see the module docstring."""
    from hydra.core.hydra_config import HydraConfig

    from fspo.runtime.checkpoints.stop_signal import honour_stop_signals
    from fspo.runtime.checks.console import quiet_third_party

    quiet_third_party()  # each console line once, third-party noise filtered (fspo/runtime/checks/console.py)
    with open_dict(cfg):
        if cfg.output_dir is None:
            cfg.output_dir = HydraConfig.get().runtime.output_dir
        if any(o.lstrip("+~").startswith("eval_data") for o in HydraConfig.get().overrides.task):
            cfg.eval_data_auto = False  # benchmarks asked for on the command line are kept
    try:
        with honour_stop_signals(outside="stopping the evaluation now (its MLflow run ends KILLED)"):
            result = evaluate(cfg)  # SIGTERM / Ctrl-C: exit 0 (fspo/runtime/checkpoints/stop_signal.py)
    except Exception as e:  # noqa: BLE001 - user errors become one clear line
        msg = user_error(e)
        if msg is None or os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"error: {msg}", file=sys.stderr)
        sys.exit(2)
    print(summary_block(cfg, result), flush=True)  # where the results went (fspo/tracking/run_summary.py)
    last = result["entries"][-1]["metrics"] if result["entries"] else {}
    return sum(v["avg_at_k"] for v in last.values()) / max(len(last), 1)


def beside_run(argv: List[str]) -> List[str]:
    """``argv`` plus ``hydra.run.dir=<run folder>/eval/<date_time>`` when it evaluates one training run's
    checkpoints and sets no output folder: the evaluation is written beside the run it scores."""
    if any(a.lstrip("+").startswith(("hydra.run.dir=", "output_dir=")) for a in argv):
        return argv
    spec = next((a.split("=", 1)[1] for a in argv if a.lstrip("+").startswith("checkpoints=")), None)
    if not spec or any(c in spec for c in "*?[],"):
        return argv
    p = Path(spec).expanduser().resolve()
    run = p.parent if p.is_file() or (p / ".metadata").exists() else p
    run = run.parent if run.name == "checkpoints" else run
    if not (run / "checkpoints").is_dir() or not os.access(run, os.W_OK):
        return argv
    return [*argv, f"hydra.run.dir={run}/eval/${{now:%Y-%m-%d_%H-%M-%S}}"]


if __name__ == "__main__":
    if (bad := unknown_key_error(sys.argv[1:], "evaluate")) is not None:  # a typo never runs the default
        print(f"error: {bad}", file=sys.stderr)
        sys.exit(2)
    sys.argv[1:] = beside_run(normalize_group_overrides(sys.argv[1:], "evaluate"))  # group=x and +group=x both work
    main()
