"""The length-fairness sweep (sweeps/length_fairness.yaml): every arm composes on the long-chain task with
its `method` and `bands` tags, and the regime-matched bands follow the rule stated in
conf/arm/fspo_matched.yaml: every method's band, as an interval of the sequence log-ratio S at the
median length L_med = 72, equals FSPO's z = 1 band c sqrt(L_med) with c = sigma_hat = 0.030.
"""
from __future__ import annotations

import math

import pytest
from hydra.utils import instantiate

from conftest import sweep_arms
from fspo.clipping.vespo import vespo_band
from fspo.sweeps import job_config, sweep_jobs

L_MED, SIGMA = 72, 0.030
BAND = SIGMA * math.sqrt(L_MED)  # 0.2546: the interval of S every matched band clips at L_med


@pytest.fixture(scope="module")
def arms():
    return sweep_arms("length_fairness")


def test_arms_compose_with_tags(arms):
    assert {"fspo_matched", "fspo_per_bin", "fspo_power", "fspo_quantile", "rloo_matched", "gspo_matched", "grpo_matched",
            "fspo_paper", "rloo_paper", "gspo_paper", "grpo_paper"} <= set(arms)
    for name, cfg in arms.items():
        method, bands = name.rsplit("_", 1) if name.endswith(("_matched", "_paper")) else (name, "matched")
        assert cfg.tags.method == cfg.method == method and cfg.tags.bands == bands, name
        assert cfg.data.train.max_ops == cfg.data.val.max_ops == 18 and cfg.steps == 40 and cfg.val.size == 128
        assert cfg.logger.experiment_name == "length_fairness"
        instantiate(cfg.clip)  # valid clip settings


def _log_bounds(clip):
    """(upper, lower) of a ratio-space band as log-ratio offsets: log(1 + high), -log(1 - low)."""
    return math.log1p(clip.clip_ratio_high), -math.log1p(-clip.clip_ratio_low)


def test_matched_bands_equal_at_median_length(arms):
    fspo = arms["fspo_matched"].clip
    assert fspo.c_upper == fspo.c_lower == pytest.approx(SIGMA)
    assert fspo.c_upper * math.sqrt(L_MED) == pytest.approx(BAND)
    for up, lo in (_log_bounds(arms["rloo_matched"].clip),):  # on S
        assert up == pytest.approx(BAND, rel=2e-3) and lo == pytest.approx(BAND, rel=2e-3)
    up, lo = _log_bounds(arms["gspo_matched"].clip)  # on S / L
    assert up * L_MED == pytest.approx(BAND, rel=2e-3) and lo * L_MED == pytest.approx(BAND, rel=2e-3)
    up, lo = _log_bounds(arms["grpo_matched"].clip)  # per token
    assert up == pytest.approx(SIGMA, rel=2e-3) and lo == pytest.approx(SIGMA, rel=2e-3)


def test_calibrated_arms_target_z_one(arms):
    for name, band in (("fspo_power", "power"), ("fspo_per_bin", "per_bin"), ("fspo_quantile", "quantile")):
        clip = arms[name].clip
        assert clip.band == band and clip.z == 1.0 and clip.ratio_grad == "per_token"


def test_optional_newer_baseline_arms_follow_the_same_rule():
    """cispo / sapo / gmpo / luspo / vespo arms (not in the default grid: add them with ``+arm=...``)."""
    extra = "+arm=cispo_matched,sapo_matched,gmpo_matched,luspo_matched,vespo_matched"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FSPO_MLFLOW_PARENT_RUN_ID", "0123abcd")
        jobs = {j[0].split("=", 1)[1]: job_config("length_fairness", j) for j in sweep_jobs("length_fairness", [extra])}
    assert set(jobs) == {"cispo_matched", "sapo_matched", "gmpo_matched", "luspo_matched", "vespo_matched"}
    for name, cfg in jobs.items():
        assert cfg.tags.bands == "matched" and cfg.tags.method == cfg.method == name[: -len("_matched")]
        instantiate(cfg.clip)
    up, lo = _log_bounds(jobs["cispo_matched"].clip)  # per-token IS weight, as GRPO
    assert up == pytest.approx(SIGMA, rel=2e-3) and lo == pytest.approx(SIGMA, rel=2e-3)
    assert jobs["gmpo_matched"].clip.clip_ratio_high == jobs["gmpo_matched"].clip.clip_ratio_low == SIGMA  # log space
    assert jobs["sapo_matched"].clip.tau_pos == pytest.approx(1.7627 / SIGMA, rel=2e-3)  # gate weight 1/2 at |r-1| = xi
    lo_v, hi_v = vespo_band(jobs["vespo_matched"].clip.k_pos, jobs["vespo_matched"].clip.lambda_pos)  # on S
    assert hi_v == pytest.approx(BAND, rel=2e-3) and -lo_v == pytest.approx(BAND, rel=2e-3)
    assert instantiate(jobs["vespo_matched"].clip).theory_clip_fraction([L_MED], SIGMA)[0] == pytest.approx(
        2 * 0.15865525, rel=5e-3)  # 2 Phi(-1): FSPO's z = 1 at L_med
    up, lo = _log_bounds(jobs["luspo_matched"].clip)  # GSPO's band on S / L
    assert up * L_MED == pytest.approx(BAND, rel=2e-3) and lo * L_MED == pytest.approx(BAND, rel=2e-3)
