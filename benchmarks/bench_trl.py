"""fspo vs TRL's GRPOTrainer: wall time of one RL step at equal work, on CPU, in one process.

Run with the benchmark environment (TRL is not a dependency of fspo; it lives only there):

    bash benchmarks/setup_trl_env.sh                                   # once: builds .venv-trl
    OMP_NUM_THREADS=1 .venv-trl/bin/python benchmarks/bench_trl.py     # 8 prompts x G 8, 64 tokens, 5 steps
    OMP_NUM_THREADS=1 .venv-trl/bin/python benchmarks/bench_trl.py --prompts 16 --G 8 --max-new-tokens 128 --steps 5
    .venv-trl/bin/python benchmarks/bench_trl.py --threads 2           # both sides get 2 cores; ours overlaps
                                                                        # generation with training (rollout.overlap)

``--threads N``: TRL runs with N torch threads; ours splits them, N//2 for the engine process and the
rest for the trainer, with ``rollout.overlap`` on (pipelined rollouts, one step stale; ``--overlap off``
gives ours all N threads in one process instead).

Both sides do the same work per RL step: ``--prompts`` prompts of our arithmetic task (the prompts
our data module gives its first steps, same text, same order), ``--G`` completions each, every
completion exactly ``--max-new-tokens`` tokens (EOS suppressed until then: our
``rollout.sampling.min_new_tokens``, TRL's ``generation_kwargs={"min_new_tokens": ...}``; checked
after the run from both sides' length metrics), temperature 1, no top-p/top-k, the same reward
(fspo's ArithmeticReward, wrapped as a TRL reward function), GRPO group z-score advantages, no
reference model / KL (TRL ``beta=0``), and the same updates: the rollout batch of prompts x G
sequences is split into mini-batches of ``--mini-batch`` sequences, one AdamW step each, one pass
(ours: ``ppo.mini_batch_size``, ``ppo.epochs=1``; TRL: ``per_device_train_batch_size`` = mini-batch,
``gradient_accumulation_steps=1``, ``steps_per_generation`` = updates per rollout batch,
``num_iterations=1``; see `trl_args`). Old log-probs: with more than one update per rollout batch
TRL computes them in an extra no-grad forward; ours takes the HF engine's (``ppo.old_log_probs=engine``,
our default with the HF engine: the same policy's log-probs, recorded while sampling); with one
update TRL reuses the loss pass's.
Same model and weights (``--model-source``: the committed warm start or the random tiny Qwen3, loaded
twice by `fspo.models.loading.load_policy`), float32, same lr (constant, no warm-up), grad-norm clip
1.0, 1 torch thread (``cpu_threads``), same Python process.

Timing, the same way on both sides: wall clock between consecutive RL-step boundaries (ours: an
``on_train_batch_end`` hook on the LightningModule; TRL: a ``TrainerCallback.on_step_end`` every
``steps_per_generation`` optimizer steps), the first interval from the start of training. So each
RL step counts everything the framework does per step (data, generation, reward, advantages,
old log-probs, update, metrics, logging). The first step (warm-up) is dropped; medians are
reported, their ratio TRL/ours, and response tokens/s (prompts x G x max_new_tokens / step time).
``--natural-lengths`` lets completions stop at EOS instead (the length mix real runs have, where
TRL pads each mini-batch to its longest and we pack): the two sides then sample different lengths,
so the fair figure is response tokens/s from each side's own mean length, reported with both means.
The phase split (ours: the ``time/*`` metrics of the run, and "other" = median step minus their sum:
Lightning's loop, MLflow logging; TRL: timers around its generate, reward-function and no-grad
log-prob calls, the rest of the step is "train_other": loss passes, optimizer, metrics, logging) is reported to show
where the time goes.

What differs, and stays different (by design of each framework, not of the work):
  - ours logs ~100 metrics per step to MLflow (a temporary SQLite store) and updates the
    length-fairness diagnostics; TRL computes its metrics (entropy, clip ratios, reward stats) but
    reports to nothing (``report_to="none"``) and only prints them (``logging_steps=1``);
  - forward/backward batching: ours packs each micro-batch's sequences into one unpadded row under a
    token budget (``ppo.micro_batch_max_tokens``) with causal attention per sequence
    (fspo/models/segment_attention.py); TRL runs each mini-batch as one padded batch with a fused,
    tiled LM-head log-prob (its ``add_fused_lm_head``);
  - the clip rule: ours ``+method=grpo`` (token clip 0.2/0.28 with dual clip c=3) vs TRL
    ``loss_type="bnpo"`` (token-mean over the mini-batch, like our token-mean), epsilon 0.2/0.28, no
    dual clip (elementwise ops; negligible cost). ``--method fspo`` times our default instead;
  - sampling RNG streams differ (the token counts do not); the AdamW implementations are both
    ``torch.optim.AdamW`` (TRL ``optim="adamw_torch"``).
Results: a table on stdout, JSON in ``--out`` (default .bench/bench_trl.json), and an MLflow run
``fspo_vs_trl`` in experiment ``bench_trl`` (our training run is logged there too, as ``fspo``).
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

from _common import PHASES, compose, latest_run, median_after_warmup, metric_history, write_json

EXPERIMENT = "bench_trl"


def fspo_overrides(prompts: int, G: int, max_new_tokens: int, steps: int, mini_batch: int, lr: float,
                   model_source: str, method: str, natural: bool = False) -> list:
    """Hydra overrides of our side for one benchmark setting (``steps`` RL steps, warm-up included);
    every completion has exactly ``max_new_tokens`` tokens unless ``natural`` (stop at EOS)."""
    min_new = 0 if natural else max_new_tokens
    return [f"+method={method}", f"steps={steps}", f"prompts_per_step={prompts}", f"rollout.sampling.n={G}",
            f"rollout.sampling.max_new_tokens={max_new_tokens}", f"rollout.sampling.min_new_tokens={min_new}",
            "rollout.sampling.temperature=1.0", "rollout.sampling.top_p=1.0", "rollout.sampling.top_k=0",
            f"ppo.mini_batch_size={mini_batch}", "ppo.epochs=1", f"ppo.lr={lr}", "ppo.warmup_steps=0",
            f"model.source={model_source}", "val.size=0", "checkpoint.every_n_steps=0", "checkpoint.save_last=false"]


def trl_args(cfg) -> dict:
    """GRPOConfig keyword arguments doing the same work per RL step as our config ``cfg``.

    One RL step = one generation of prompts_per_step x G completions followed by
    ``ppo.epochs x (B / ppo.mini_batch_size)`` optimizer steps of ``mini_batch_size`` sequences
    (B = prompts_per_step x G), so: per_device_train_batch_size = mini_batch_size,
    gradient_accumulation_steps = 1, steps_per_generation = B / mini_batch_size (generation batch = B),
    num_iterations = ppo.epochs, max_steps = steps x updates per RL step. Pure (no TRL import)."""
    P, s = int(cfg.prompts_per_step), cfg.rollout.sampling
    G, M, epochs = int(s.n), int(cfg.ppo.mini_batch_size), int(cfg.ppo.epochs)
    B = P * G
    if G < 2:
        raise ValueError(f"TRL's GRPO needs G = rollout.sampling.n >= 2, got {G}")
    if M < 1 or B % M:
        raise ValueError(f"the rollout batch {P} x {G} = {B} must be a multiple of ppo.mini_batch_size={M} "
                         f"(TRL has no short last mini-batch)")
    min_new = int(s.get("min_new_tokens", 0) or 0)
    return {
        "per_device_train_batch_size": M,
        "gradient_accumulation_steps": 1,
        "steps_per_generation": B // M,
        "num_generations": G,
        "num_iterations": epochs,
        "max_steps": int(cfg.steps) * epochs * (B // M),
        "max_completion_length": int(s.max_new_tokens),
        "generation_kwargs": {"min_new_tokens": min_new} if min_new else None,
        "temperature": float(s.temperature),
        "top_p": float(s.top_p),
        "top_k": int(s.top_k) if int(s.top_k) > 0 else 0,
        "learning_rate": float(cfg.ppo.lr),
        "lr_scheduler_type": "constant",
        "warmup_steps": int(cfg.ppo.warmup_steps),
        "weight_decay": float(cfg.ppo.weight_decay),
        "max_grad_norm": float(cfg.ppo.max_grad_norm),
        "optim": "adamw_torch",
        "beta": 0.0,                     # no reference model, no KL (as ours)
        "loss_type": "bnpo",             # token-mean over the mini-batch (our token-mean)
        "scale_rewards": "group",        # GRPO z-score within each group
        "epsilon": 0.2,
        "epsilon_high": 0.28,
        "shuffle_dataset": False,        # prompts in our data module's order
        "seed": int(cfg.seed),
        "bf16": False, "fp16": False,    # float32 like ours (TRL defaults to bf16)
        "gradient_checkpointing": False,  # TRL defaults to True; we do not recompute activations
        "use_cpu": True,
        "report_to": "none",
        "logging_steps": 1,
        "save_strategy": "no",
        "eval_strategy": "no",
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        "log_completions": False,
        "mask_truncated_completions": False,
    }


def _step_prompts(cfg):
    """The (prompt, answer) pairs our data module yields, step by step, for ``cfg.steps`` steps."""
    from hydra.utils import instantiate

    from fspo.data.datamodule import PromptDataModule

    dm = PromptDataModule(instantiate(cfg.data.train), None, prompts_per_step=int(cfg.prompts_per_step),
                          steps=int(cfg.steps), seed=int(cfg.seed))
    return [list(zip(b["prompts"], b["answers"])) for b in dm.train_dataloader()]


# ---------------------------------------------------------------------------------------- TRL side
def run_trl(cfg, out_dir: Path, threads: int = 0) -> dict:
    import torch
    from datasets import Dataset
    from hydra.utils import instantiate
    from omegaconf import OmegaConf
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from fspo.models.loading import load_policy

    if threads or cfg.get("cpu_threads"):
        torch.set_num_threads(int(threads or cfg.cpu_threads))
    kw = trl_args(cfg)
    per_rl = kw["steps_per_generation"] * kw["num_iterations"]
    rows = [{"prompt": p, "answer": a} for step in _step_prompts(cfg) for p, a in step]
    reward = instantiate(cfg.reward)
    T = int(cfg.rollout.sampling.max_new_tokens)

    def arithmetic_reward(prompts, completions, completion_ids, answer, **_):
        lengths = [len(c) for c in completion_ids]
        overlong = [n >= T for n in lengths]
        return [float(x) for x in reward(completions, answer, lengths, overlong, T).scores]

    phases = {"generate": 0.0, "reward": 0.0, "old_log_probs": 0.0}

    def timed(phase, fn, *a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            phases[phase] += time.perf_counter() - t0

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate_single_turn(self, *a, **k):
            return timed("generate", super()._generate_single_turn, *a, **k)

        def _get_per_token_logps_and_entropies(self, *a, **k):  # without grad: the old log-prob pass
            fn = super()._get_per_token_logps_and_entropies
            return fn(*a, **k) if torch.is_grad_enabled() else timed("old_log_probs", fn, *a, **k)

        def _calculate_rewards(self, *a, **k):
            return timed("reward", super()._calculate_rewards, *a, **k)

    marks, split, lengths = [], [], {"min": [], "max": [], "mean": []}

    class StepTimer(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw_):
            marks.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw_):
            if state.global_step % per_rl == 0:
                marks.append(time.perf_counter())
                split.append(dict(phases))
                phases.update({k: 0.0 for k in phases})

        def on_log(self, args, state, control, logs=None, **kw_):
            for k in ("min", "max", "mean"):
                v = (logs or {}).get(f"completions/{k}_length")
                if v is not None:
                    lengths[k].append(float(v))

    model, tok = load_policy(**OmegaConf.to_container(cfg.model, resolve=True), seed=int(cfg.seed))
    args = GRPOConfig(output_dir=str(out_dir), **kw)
    trainer = TimedGRPOTrainer(model=model, reward_funcs=arithmetic_reward, args=args,
                               train_dataset=Dataset.from_list(rows), processing_class=tok,
                               callbacks=[StepTimer()])
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    steps = [b - a for a, b in zip(marks, marks[1:])]
    med = median_after_warmup(steps)
    ph = {k: median_after_warmup([s[k] for s in split]) for k in phases}
    ph["train_other"] = med - sum(ph.values())
    return {"step_times_s": steps, "median_step_s": med, "phases_s": ph, "wall_s": wall,
            "optimizer_steps": trainer.state.global_step, "updates_per_rl_step": per_rl,
            "response_len": {k: (min(v) if k == "min" else max(v) if k == "max" else statistics.mean(v))
                             if v else float("nan") for k, v in lengths.items()},
            "grpo_config": {k: v for k, v in kw.items()}}


# ---------------------------------------------------------------------------------------- our side
def run_fspo(cfg, uri: str) -> dict:
    import mlflow

    import fspo.train as ft

    marks = []

    class TimedRLModule(ft.RLModule):  # wall-clock RL-step boundaries, read by the benchmark only
        def on_train_start(self):
            marks.append(time.perf_counter())

        def on_train_batch_end(self, outputs, batch, batch_idx):
            marks.append(time.perf_counter())

    original = ft.RLModule
    ft.RLModule = TimedRLModule
    try:
        t0 = time.perf_counter()
        ft.train(cfg)
        wall = time.perf_counter() - t0
    finally:
        ft.RLModule = original
    client = mlflow.MlflowClient(uri)
    run = latest_run(client, EXPERIMENT, "fspo")

    def hist(key):
        return metric_history(client, run.info.run_id, key)

    steps = [b - a for a, b in zip(marks, marks[1:])]
    ph = {p: median_after_warmup(hist(f"time/{p}")) for p in PHASES}
    med = median_after_warmup(steps)
    ph["other"] = med - sum(v for v in ph.values() if v == v)  # Lightning loop, MLflow logging, hooks
    lens = hist("rollout/response_len_mean")
    return {"step_times_s": steps, "median_step_s": med, "phases_s": ph, "wall_s": wall,
            "perf_step_time_s": median_after_warmup(hist("perf/step_time_s")),
            "padding_waste": median_after_warmup(hist("perf/padding_waste")),
            "response_len": {"mean": statistics.mean(lens) if lens else float("nan"),
                             "max": max(hist("rollout/response_len_max") or [float("nan")])},
            "mlflow_run_id": run.info.run_id}


# ---------------------------------------------------------------------------------------- main
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8, help="prompts per RL step")
    ap.add_argument("--G", type=int, default=8, help="completions per prompt (num_generations)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="every completion has exactly this many tokens")
    ap.add_argument("--steps", type=int, default=5, help="timed RL steps (one warm-up step is added)")
    ap.add_argument("--mini-batch", type=int, default=32, help="sequences per optimizer step (ppo.mini_batch_size)")
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--model-source", default="warmstart", choices=["warmstart", "random"])
    ap.add_argument("--method", default="grpo", help="our clip rule / advantage preset (+method=)")
    ap.add_argument("--natural-lengths", action="store_true",
                    help="completions stop at EOS (a length mix; the sides' lengths then differ by sampling, "
                         "so compare response tokens/s, from each side's own mean length)")
    ap.add_argument("--order", default="trl,fspo", help="which side runs first")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads per side (TRL: all of them; ours: split between trainer and engine process "
                         "when --overlap); 0: cpu_threads of the config")
    ap.add_argument("--overlap", default="auto", choices=["auto", "on", "off"],
                    help="our rollout.overlap (pipelined rollouts, one step stale); auto: on when --threads >= 2")
    ap.add_argument("--out", default=".bench/bench_trl.json")
    ap.add_argument("--tracking-uri", default=None, help="MLflow URI (default: a temporary SQLite store)")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for our side (and the mapping), after --")
    a = ap.parse_args(argv)
    order = [s.strip() for s in a.order.split(",")]
    if sorted(order) != ["fspo", "trl"]:
        ap.error("--order must name fspo and trl, e.g. trl,fspo")

    import mlflow

    tmp = Path(tempfile.mkdtemp(prefix="fspo_bench_trl_"))
    uri = a.tracking_uri or f"sqlite:///{tmp}/mlflow.db"
    overlap = a.overlap == "on" or (a.overlap == "auto" and a.threads >= 2)
    threads = []
    if overlap:  # the engine process gets half the threads, the trainer the rest
        engine = max(1, a.threads // 2)
        threads = ["rollout.overlap.enable=true", f"rollout.overlap.engine_threads={engine}",
                   f"cpu_threads={max(1, a.threads - engine)}"]
    elif a.threads:
        threads = [f"cpu_threads={a.threads}"]
    cfg = compose(fspo_overrides(a.prompts, a.G, a.max_new_tokens, a.steps + 1, a.mini_batch, a.lr,
                                     a.model_source, a.method, a.natural_lengths) + threads
                      + [f"output_dir={tmp}/fspo", f"logger.tracking_uri={uri}",
                         f"logger.experiment_name={EXPERIMENT}", "run_name=fspo", *a.overrides])
    trl_args(cfg)  # fail fast on a setting TRL cannot express

    res = {}
    for side in order:
        print(f"=== {side} ===", flush=True)
        res[side] = run_trl(cfg, tmp / "trl", a.threads) if side == "trl" else run_fspo(cfg, uri)

    import torch
    import transformers
    import trl

    T, B = a.max_new_tokens, a.prompts * a.G
    ours, theirs = res["fspo"], res["trl"]
    if a.natural_lengths:  # each side's own mean response length
        tok = {"fspo": B * ours["response_len"]["mean"], "trl": B * theirs["response_len"]["mean"]}
        lengths_ok = None
    else:
        tok = {"fspo": B * T, "trl": B * T}
        lengths_ok = all(abs(v - T) < 1e-9 for v in (ours["response_len"]["mean"], ours["response_len"]["max"],
                                                       theirs["response_len"]["min"], theirs["response_len"]["max"]))
    tokens = tok["fspo"]
    summary = {
        "settings": {"prompts": a.prompts, "G": a.G, "max_new_tokens": T,
                     "min_new_tokens": 0 if a.natural_lengths else T, "natural_lengths": a.natural_lengths,
                     "timed_steps": a.steps, "warmup_steps": 1, "mini_batch": a.mini_batch,
                     "updates_per_rl_step": B // a.mini_batch, "lr": a.lr, "model_source": a.model_source,
                     "method": a.method, "order": order, "overrides": a.overrides,
                     "cpu_threads": cfg.get("cpu_threads"), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
                     "threads": a.threads, "overlap": overlap},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__},
        "loadavg": os.getloadavg(),
        "response_tokens_per_step": tokens,
        "lengths_equal": lengths_ok,
        "fspo": ours, "trl": theirs,
        "ratio_trl_over_fspo": theirs["median_step_s"] / ours["median_step_s"],
        "tokens_per_s": {"fspo": tok["fspo"] / ours["median_step_s"], "trl": tok["trl"] / theirs["median_step_s"]},
    }
    summary["ratio_tokens_per_s_fspo_over_trl"] = summary["tokens_per_s"]["fspo"] / summary["tokens_per_s"]["trl"]
    r = summary["ratio_trl_over_fspo"]
    lengths = "max, natural lengths" if a.natural_lengths else "fixed"
    print(f"\nRL step, {a.prompts} prompts x G {a.G} x {T} tokens ({lengths}), {B // a.mini_batch} updates/step, "
          f"median of {a.steps} steps after 1 warm-up, load {summary['loadavg'][0]:.2f}")
    print(f"{'side':<8}{'median s/step':>15}{'resp tok/s':>12}   steps (s)")
    for side in ("fspo", "trl"):
        s = res[side]
        print(f"{side:<8}{s['median_step_s']:>15.3f}{tok[side] / s['median_step_s']:>12.0f}   "
              + " ".join(f"{x:.2f}" for x in s["step_times_s"]))
    print(f"ratio TRL/fspo: {r:.2f}x  ({'fspo faster' if r > 1 else 'TRL faster'}; goal >= 2x); "
          f"tokens/s fspo/TRL {summary['ratio_tokens_per_s_fspo_over_trl']:.2f}x")
    print("phases fspo: " + ", ".join(f"{k} {v:.3f}" for k, v in ours["phases_s"].items()))
    print("phases trl:  " + ", ".join(f"{k} {v:.3f}" for k, v in theirs["phases_s"].items()))
    print(f"response lengths: fspo mean {ours['response_len']['mean']:.1f} max {ours['response_len']['max']:.0f}; "
          f"trl mean {theirs['response_len']['mean']:.1f} min {theirs['response_len']['min']:.0f} "
          f"max {theirs['response_len']['max']:.0f} -> "
          + ("natural lengths: compare tokens/s" if lengths_ok is None else
             'equal' if lengths_ok else 'NOT EQUAL: the comparison is not at equal work'))

    out = write_json(a.out, summary, default=str)
    client = mlflow.MlflowClient(uri)
    exp = client.get_experiment_by_name(EXPERIMENT)
    run = client.create_run(exp.experiment_id, run_name="fspo_vs_trl")
    rid = run.info.run_id
    for k, v in summary["settings"].items():
        client.log_param(rid, k, str(v))
    for k, v in summary["versions"].items():
        client.log_param(rid, f"version_{k}", v)
    flat = {"bench/fspo_step_s": ours["median_step_s"], "bench/trl_step_s": theirs["median_step_s"],
            "bench/ratio_trl_over_fspo": r, "bench/fspo_tokens_per_s": summary["tokens_per_s"]["fspo"],
            "bench/trl_tokens_per_s": summary["tokens_per_s"]["trl"],
            "bench/tokens_per_s_fspo_over_trl": summary["ratio_tokens_per_s_fspo_over_trl"],
            "bench/lengths_equal": float("nan") if lengths_ok is None else float(lengths_ok),
            "bench/fspo_response_len_mean": ours["response_len"]["mean"],
            "bench/trl_response_len_mean": theirs["response_len"]["mean"],
            "bench/loadavg_1m": summary["loadavg"][0],
            **{f"bench/fspo_phase_{k}_s": v for k, v in ours["phases_s"].items() if v == v},
            **{f"bench/trl_phase_{k}_s": v for k, v in theirs["phases_s"].items() if v == v}}
    for k, v in flat.items():
        if math.isfinite(v):
            client.log_metric(rid, k, float(v))
    client.log_dict(rid, summary, "bench_trl.json")
    client.set_terminated(rid)
    print(f"{out}: MLflow {uri} experiment {EXPERIMENT} run {rid}")
    return summary


if __name__ == "__main__":
    main()
