"""Which benchmarks an evaluation runs. An ``eval_data.<name>`` node holds ``source`` (instantiated),
``samples_per_prompt`` and optionally ``reward`` (default: the evaluator's), ``max_new_tokens`` (default:
``sampling.max_new_tokens``) and ``from_run`` (copy the training run's data settings, so the built-in set
stays disjoint from the run's train and validation splits).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional

from omegaconf import DictConfig, OmegaConf, open_dict

log = logging.getLogger(__name__)

BUILTIN_TASK = "fspo.data.arithmetic.ArithmeticTask"
BUILTIN_EVAL_SET = "arithmetic"
EVAL_DATA_DIR = Path(__file__).resolve().parents[2] / "conf" / "eval_data"


@dataclass
class Benchmark:
    """One benchmark ready to run: prompts, samples per prompt, optional own scorer / budget."""

    source: Any
    k: int
    reward: Optional[Dict[str, Any]] = None  # a Hydra node; None: the evaluator's reward
    max_new_tokens: Optional[int] = None     # None: sampling.max_new_tokens


def uses_builtin_task(run_cfg: Optional[DictConfig]) -> bool:
    """True when the training run's config trains on the built-in arithmetic task."""
    target = OmegaConf.select(run_cfg, "data.train._target_") if run_cfg is not None else None
    return target == BUILTIN_TASK


def select_eval_data(cfg: DictConfig, run_cfg: Optional[DictConfig]) -> None:
    """Settle ``cfg.eval_data`` in place: with ``eval_data_auto`` and a built-in-task run, the built-in set replaces
    the configured benchmarks; every ``from_run`` node takes the run's data settings."""
    with open_dict(cfg):
        if cfg.get("eval_data_auto", False) and uses_builtin_task(run_cfg):
            node = OmegaConf.load(EVAL_DATA_DIR / f"{BUILTIN_EVAL_SET}.yaml")
            log.info("the training run used the built-in task: evaluating on eval_data=[%s] (held-out problems) "
                     "instead of %s", BUILTIN_EVAL_SET, list(cfg.get("eval_data") or {}))
            cfg.eval_data = {BUILTIN_EVAL_SET: node}
        for bench in (cfg.get("eval_data") or {}).values():
            if bench.get("from_run") and uses_builtin_task(run_cfg):
                _match_run(bench, run_cfg)


def _match_run(bench: DictConfig, run_cfg: DictConfig) -> None:
    train = OmegaConf.to_container(run_cfg.data.train, resolve=True)
    src = bench.source
    for key in ("seed", "min_ops", "max_ops", "max_operand"):
        if key in train:
            src[key] = train[key]
    src.exclude_size = int(train.get("size", src.exclude_size))
    val_size = OmegaConf.select(run_cfg, "data.val.size") or OmegaConf.select(run_cfg, "val.size")
    if val_size is not None:
        src.val_size = int(val_size)
    budget = OmegaConf.select(run_cfg, "rollout.sampling.max_new_tokens")
    if budget is not None and "max_new_tokens" in bench:
        bench.max_new_tokens = int(budget)


def build_benchmarks(cfg: DictConfig) -> Dict[str, Benchmark]:
    """name -> `Benchmark`, with the global ``limit`` (first N problems) and ``k`` overrides."""
    from hydra.utils import instantiate

    from fspo.data.base import ListSource

    if not cfg.get("eval_data"):
        raise ValueError("no benchmarks selected: set eval_data=[math500,aime24,aime25] (conf/eval_data/)")
    out = {}
    for name, bench in cfg.eval_data.items():
        node = OmegaConf.to_container(bench.source, resolve=True)
        limit = None if cfg.limit is None else int(cfg.limit)
        if limit is not None and "limit" in node:
            node["limit"] = limit
        source = instantiate(node)
        if limit is not None and "limit" not in node and limit < len(source):
            source = ListSource([source[i] for i in range(limit)], name=str(name))
        reward = OmegaConf.to_container(bench.reward, resolve=True) if bench.get("reward") else None
        budget = bench.get("max_new_tokens")
        out[str(name)] = Benchmark(source, int(cfg.k if cfg.k is not None else bench.samples_per_prompt), reward,
                                   None if budget is None else int(budget))
    return out
