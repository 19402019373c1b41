"""The length-law sweep (issue 30, sweeps/length_law.yaml) and its task (conf/data/arithmetic_law.yaml).

The task's worked solutions span >= 8x in length, up to >= 512 tokens (the tiny tokenizer: one token a
character), every line the same kind of step; every arm composes on it with its tags; the matched bands
follow conf/arm/fspo_matched.yaml's rule at this task's median length L_med = 288: every method's band,
as an interval of S at L_med, is FSPO's c sqrt(L_med) with c = 0.030.
"""
from __future__ import annotations

import math
import statistics

import pytest
from hydra.utils import instantiate

from conftest import sweep_arms
from fspo.data.arithmetic import worked_solution

L_MED, SIGMA = 288, 0.030
BAND = SIGMA * math.sqrt(L_MED)  # 0.5091


@pytest.fixture(scope="module")
def arms():
    return sweep_arms("length_law")


def test_task_spans_8x_up_to_512_tokens(arms):
    """Reference responses (worked solution + EOS) of 2000 train problems: min, median, max in tokens."""
    cfg = arms["fspo_matched"]
    task = instantiate(cfg.data.train, size=2000)
    lengths = [len(worked_solution(s.meta["nums"], s.meta["ops"])[0]) + 1 for s in (task[i] for i in range(len(task)))]
    lo, med, hi = min(lengths), statistics.median(lengths), max(lengths)
    assert hi >= 512 and hi / lo >= 8, (lo, med, hi)
    assert abs(med - L_MED) / L_MED < 0.1, med  # the matched bands' L_med
    assert hi <= cfg.rollout.sampling.max_new_tokens
    prompts = [len(task[i].prompt) for i in range(len(task))]
    assert max(prompts) <= cfg.data.max_prompt_len


def test_arms_compose_with_tags(arms):
    assert set(arms) == {"fspo_matched", "rloo_law", "gspo_law", "grpo_matched", "fspo_quantile", "fspo_power",
                         "ctpo_matched"}
    for name, cfg in arms.items():
        assert cfg.tags.method == cfg.method == name.split("_")[0] + ("_" + name.split("_")[1]
                                                                      if name in ("fspo_quantile", "fspo_power") else "")
        assert cfg.data.train.max_ops == 64 and cfg.rollout.sampling.max_new_tokens == 640
        assert cfg.logger.experiment_name == "length_law" and cfg.model.path == "fspo/assets/tiny_warmstart_long"
        instantiate(cfg.clip)


def _log_bounds(clip):
    return math.log1p(clip.clip_ratio_high), -math.log1p(-clip.clip_ratio_low)


def test_matched_bands_equal_at_median_length(arms):
    fspo = arms["fspo_matched"].clip
    assert fspo.c_upper * math.sqrt(L_MED) == pytest.approx(BAND)
    up, lo = _log_bounds(arms["rloo_law"].clip)  # on S
    assert up == pytest.approx(BAND, rel=1e-4) and lo == pytest.approx(BAND, rel=1e-4)
    up, lo = _log_bounds(arms["gspo_law"].clip)  # on S / L
    assert up * L_MED == pytest.approx(BAND, rel=1e-4) and lo * L_MED == pytest.approx(BAND, rel=1e-4)
    up, lo = _log_bounds(arms["grpo_matched"].clip)  # per token
    assert up == pytest.approx(SIGMA, rel=2e-3) and lo == pytest.approx(SIGMA, rel=2e-3)


def test_long_warm_start_fits_prompt_and_response(arms):
    """The engine refuses prompt + max_new_tokens above max_position_embeddings: the long-chain warm start
    raises it (RoPE has no position table, experiments/warmstart.py --max-positions)."""
    import json
    from pathlib import Path

    cfg = arms["fspo_matched"]
    asset = Path(__file__).resolve().parents[1] / cfg.model.path
    config = json.loads((asset / "config.json").read_text())
    assert config["max_position_embeddings"] >= cfg.data.max_prompt_len + cfg.rollout.sampling.max_new_tokens
    assert config["rope_parameters"]["rope_type"] == "default"
    made = json.loads((asset / "warmstart.json").read_text())["args"]
    assert made["init"] == "fspo/assets/tiny_warmstart" and made["max_ops"] == 64 and made["min_ops"] == 4
