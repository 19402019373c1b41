"""The console of a run: each line once, no third-party noise, and the progress in RL steps.

Owns: the progress line's formatting with hand-set metrics (ETA arithmetic by hand), the choice of
progress callback per mode, the `progress.*` config checks, `quiet_third_party` in a fresh process
(Lightning's duplicate handler, the litlogger tip and the pytree FutureWarning gone, other INFO lines
and other warnings kept), and one real tiny run (subprocess, stdout+stderr to a pipe, i.e. not a TTY)
whose output has each Lightning line once, none of the known noise, the plain progress lines and no
tqdm carriage returns. No mocks.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from conftest import REPO, SMALL, compose_config
from fspo.runtime.checks.config_check import ConfigError, check_config
from fspo.tracking.progress import StepBar, StepLines, format_eta, make_progress, progress_line, short_metrics


def test_format_eta_by_hand():
    assert format_eta(0) == "0:00"
    assert format_eta(70) == "1:10"
    assert format_eta(59.6) == "1:00"               # rounds to the second
    assert format_eta(3725) == "1:02:05"            # 1 h 2 min 5 s
    assert format_eta(float("nan")) == "?" and format_eta(-1) == "?"


def test_progress_line_hand_set_metrics():
    metrics = {"reward/mean": torch.tensor(0.4375), "val/accuracy": 0.6074, "clip/seq_frac": 0.0703,
               "fairness/lre": 0.0361, "rollout/response_len_mean": 43.414, "train/loss": 1.0, "v_num": 3}
    # 40 steps left x 1.75 s/step = 70 s = 1:10
    assert progress_line(20, 60, 1.75, metrics) == (
        "step 20/60 | 1.75 s/step | ETA 1:10 | reward 0.438 | val acc 0.607 | binding clip 0.070 | LRE 0.036"
        " | len 43.4")
    # 2 steps left x 0.5 s = 1 s; metrics not logged yet are left out (no LRE with one mini-batch)
    assert progress_line(1, 3, 0.5, {"reward/mean": 0.25}) == "step 1/3 | 0.50 s/step | ETA 0:01 | reward 0.250"
    assert progress_line(0, 60, None, {}) == "step 0/60"
    # the bar's postfix: short names, no v_num, FIELDS order
    assert list(short_metrics(metrics)) == ["reward", "val acc", "binding clip", "LRE", "len"]


def test_make_progress_modes():
    assert isinstance(make_progress("auto", 5, 60, is_tty=True, columns=120), StepBar)
    assert isinstance(make_progress("auto", 5, 60, is_tty=True, columns=0), StepLines)  # a 0-column terminal
    bar = make_progress("bar", 5, 60)
    assert bar.init_validation_tqdm().disable and bar.init_sanity_tqdm().disable  # no "Validation DataLoader 0"
    lines = make_progress("auto", 5, 60, is_tty=False)
    assert isinstance(lines, StepLines) and (lines.total, lines.every_n_steps) == (60, 5)
    assert isinstance(make_progress("lines", 5, 60, is_tty=True), StepLines)
    assert isinstance(make_progress("bar", 5, 60, is_tty=False), StepBar)
    assert make_progress("off", 5, 60) is None
    with pytest.raises(ValueError, match="progress.mode='loud'"):
        make_progress("loud", 5, 60)


@pytest.mark.parametrize("override, match", [("progress.mode=loud", r"^progress\.mode=loud: "),
                                             ("progress.every_n_steps=0", r"^progress\.every_n_steps=0: ")])
def test_bad_progress_settings_fail_first(tmp_path, override, match):
    cfg = compose_config([*SMALL, override], output_dir=tmp_path / "run", tracking_uri=f"sqlite:///{tmp_path}/m.db")
    with pytest.raises(ConfigError, match=match):
        check_config(cfg)


QUIET_SNIPPET = r"""
import logging, sys, warnings
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="[%(name)s][%(levelname)s] - %(message)s")
from fspo.runtime.checks.console import LITLOGGER_TIP, quiet_third_party
quiet_third_party()
quiet_third_party()   # idempotent: a sweep calls it once per job
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from lightning.pytorch.utilities._pytree import _tree_flatten
rank_zero_info("GPU available: False, used: False")
rank_zero_info(LITLOGGER_TIP + " ... litlogger")
_tree_flatten(1.0)                                      # torch's LeafSpec FutureWarning, filtered
warnings.warn("a warning that matters", UserWarning)    # kept
print("filters on rank_zero:", len(logging.getLogger("lightning.pytorch.utilities.rank_zero").filters))
"""


@pytest.mark.slow  # > 2.5 s: out of the quick loop (-m "not slow"), still in CI
def test_quiet_third_party_in_a_fresh_process():
    """A fresh process (the filters are process-wide): Hydra-like root handler, then the known noise."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", QUIET_SNIPPET], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout + proc.stderr
    assert out.count("GPU available: False") == 1                       # once: the root handler's copy
    assert "[lightning.pytorch.utilities.rank_zero][INFO] - GPU available" in proc.stdout
    assert "INFO: GPU available" not in out                              # lightning's own handler removed
    assert "litlogger" not in out and "LeafSpec" not in out
    assert "a warning that matters" in proc.stderr
    assert "filters on rank_zero: 1" in proc.stdout


@pytest.mark.slow
def test_tiny_run_console_is_clean(tiny_run):
    """A real 3-step run of the warm-started tiny model (loaded with from_pretrained, so Lightning's
    eval-mode check runs) with output to a pipe: the plain progress lines, each Lightning line once, no noise.
    The run is conftest's shared `tiny_run` (SMALL on the warm start, steps=3, progress.every_n_steps=2)."""
    out = tiny_run["stdout"] + tiny_run["stderr"]
    lines = out.splitlines()
    lightning = [re.sub(r"^\[[^]]*\]", "", ln) for ln in lines if "[lightning." in ln or ln.startswith("INFO: ")]
    assert lightning and len(lightning) == len(set(lightning)), lightning
    assert not any(ln.startswith("INFO: ") for ln in lines)              # Lightning's duplicate handler
    for noise in ("litlogger", "module(s) in eval mode", "LeafSpec", "Loading weights", "Epoch 0/0", "v_num",
                  "Creating initial MLflow database tables"):
        assert noise not in out, noise
    assert "\r" not in out                                               # no tqdm / Rich redraws
    progress = [ln.split(" - ", 1)[1] for ln in lines if "[fspo.tracking.progress]" in ln]
    assert [p.split(" | ")[0] for p in progress] == ["step 2/3", "step 3/3"], progress
    for p in progress:
        assert re.search(r" \| \d+\.\d\d s/step \| ETA \d+:\d\d \| reward \d\.\d{3} \| val acc \d\.\d{3}", p), p
    assert progress[-1].split(" | ")[2] == "ETA 0:00"
