"""The length-law sweep (sweeps/length_law.yaml) on its task (conf/data/mod_chain.yaml).

The task's reference responses span >= 20x in length, evenly in log L, with a prompt of fixed length; every arm
composes with its tags; mini-batches hold whole groups; the matched bands follow conf/arm/fspo_law.yaml's rule
at the pilot's median length L_med = 114: every method's band, as an interval of S at L_med, is FSPO's
c sqrt(L_med) with c = 0.0015; the knock-out arm keeps advantages on the shortest third only.
"""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
from hydra.utils import instantiate

from conftest import sweep_arms
from fspo.data.mod_chain import chain_lines

L_MED, SIGMA = 114, 0.0015
BAND = SIGMA * math.sqrt(L_MED)  # 0.016016
ARMS = {"fspo_law", "rloo_law", "gspo_law", "vespo_law", "measure", "knock"}


@pytest.fixture(scope="module")
def arms():
    return sweep_arms("length_law")


def test_task_spans_20x_with_a_fixed_prompt(arms):
    cfg = arms["fspo_law"]
    task = instantiate(cfg.data.train, size=4000)
    lengths = [len("\n".join(chain_lines(s.meta["v0"], s.meta["n"]))) + 1 for s in (task[i] for i in range(len(task)))]
    lo, med, hi = min(lengths), statistics.median(lengths), max(lengths)
    assert (lo, hi) == (24, 600) and hi / lo >= 20
    assert abs(med - L_MED) / L_MED < 0.15, med  # the matched bands' L_med (the pilot's generated median)
    assert hi <= cfg.rollout.sampling.max_new_tokens
    assert {len(task[i].prompt) for i in range(len(task))} == {10} and cfg.data.max_prompt_len >= 10


def test_arms_compose_with_tags_and_whole_group_mini_batches(arms):
    assert set(arms) == ARMS
    for name, cfg in arms.items():
        assert cfg.tags.method == cfg.method and (cfg.tags.bands == "knock") == (name == "knock")
        assert cfg.ppo.mini_batch_unit == "prompts" and cfg.loss_agg_mode == "token-mean"
        assert cfg.logger.experiment_name == "length_law" and cfg.model.path == "fspo/assets/tiny_warmstart_chain"
        assert cfg.reward._target_ == "fspo.rewards.mod_chain.ChainConsistencyReward"
        instantiate(cfg.clip)
        assert (cfg.advantage_mask is not None) == (name == "knock")
    assert arms["knock"].advantage_mask.fraction == pytest.approx(0.333)
    assert arms["measure"].clip.c_upper >= 10  # never binds


def _log_bounds(clip):
    return math.log1p(clip.clip_ratio_high), -math.log1p(-clip.clip_ratio_low)


def test_matched_bands_equal_at_median_length(arms):
    fspo = arms["fspo_law"].clip
    assert fspo.c_upper * math.sqrt(L_MED) == pytest.approx(BAND)
    up, lo = _log_bounds(arms["rloo_law"].clip)  # on S
    assert up == pytest.approx(BAND, rel=1e-4) and lo == pytest.approx(BAND, rel=1e-4)
    up, lo = _log_bounds(arms["gspo_law"].clip)  # on S / L
    assert up * L_MED == pytest.approx(BAND, rel=1e-4) and lo * L_MED == pytest.approx(BAND, rel=1e-4)


def test_chain_warm_start_fits_prompt_and_response(arms):
    cfg = arms["fspo_law"]
    asset = Path(__file__).resolve().parents[1] / cfg.model.path
    config = json.loads((asset / "config.json").read_text())
    assert config["max_position_embeddings"] >= cfg.data.max_prompt_len + cfg.rollout.sampling.max_new_tokens
    made = json.loads((asset / "warmstart.json").read_text())
    assert made["args"]["task"] == "mod_chain" and made["args"]["slip"] == 0.3
    by_len = made["history"][-1]["sampled_acc_by_length"]  # mean credit at T = 1, per length bin
    assert all(0.3 <= c <= 0.8 for c, n in by_len.values() if n >= 8), by_len


def test_planned_size_has_power(arms):
    """benchmarks/law_power.py at the planned measured sequences per arm: every target passes with probability
    >= 0.8 when the law holds exactly (a small simulation here; the script's default is 300 sweeps)."""
    from law_power import main

    cfg = arms["fspo_law"]
    measured = cfg.steps * cfg.prompts_per_step * cfg.rollout.sampling.n * 3 // 4
    p = main(["--seqs", str(measured), "--sims", "40", "--seed", "1"])
    assert p["all"] >= 0.8, p
