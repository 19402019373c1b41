"""The MLflow layout of a training run: few chart sections, settings as params,
distinct descriptive run names, the experiment's description, the LRE-by-step figure, and the report
reading the new key layout back.

The slow test launches experiments/run.py twice into one SQLite store, as a user would (conftest's shared
tiny run, then the same command again into a copy of its store); the others check the pieces by hand-computed
examples. No mocks.
"""
from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from fspo.diagnostics.metric_keys import canonical_key, display_key
from fspo.tracking.naming import EXPERIMENT_NOTE, NOTE_TAG, default_run_name, describe_experiment
from fspo.tracking.run_figures import lre_by_step_figure

NAME_RE = re.compile(r"^fspo-tiny-s42-\d{4}-\d{6}$")
# one section per top-level family of the default run: band clip fairness guard logratio perf reward
# rollout run time train val (12; before this layout 36, each per-bin family and each run/ family its
# own); optional features add their family (rollout_corr/, dynamic_sampling/), one section each
# + "Headline" (first: copies of held-out accuracy, LRE, out-of-band by length), "zz counts" (last) and
# "model" (model/trainable_params, model/total_params, logged once)
MAX_SECTIONS = 15
CONSTANT_SETTINGS = ("clip/c_upper", "clip/c_lower", "clip/c_dual", "train/lr")  # fixed band, no warmup


def section(key: str) -> str:
    """The chart section MLflow 3.x's UI puts ``key`` in: everything before the last '/'."""
    return key.rsplit("/", 1)[0] if "/" in key else ""


def test_display_key_keeps_one_section_per_family_and_round_trips():
    assert display_key("clip/seq_frac/len_00016_00032") == "clip/seq_frac.len_00016_00032"
    assert display_key("run/band/out_frac/len_00000_00016") == "run/band.out_frac.len_00000_00016"
    assert display_key("val/accuracy") == "val/accuracy" and display_key("steps") == "steps"
    assert section(display_key("run/logratio/std/len_00000_00016")) == "run"
    for k in ("clip/seq_frac/len_00016_00032", "run/band/out_frac/len_0_16", "val/accuracy", "x"):
        assert canonical_key(display_key(k)) == k
    # keys of runs logged before this layout (several '/') and benchmark names with dots are left alone
    assert canonical_key("clip/seq_frac/len_00016_00032") == "clip/seq_frac/len_00016_00032"
    assert canonical_key("eval/math.500/avg_at_4") == "eval/math.500/avg_at_4"


def test_counts_go_last_and_the_headline_copies_come_first():
    from fspo.diagnostics.metric_keys import headline, is_count

    assert display_key("band/n_seq/len_00000_00016") == "zz counts/band.n_seq.len_00000_00016"
    assert display_key("run/logratio/qq_n") == "zz counts/run.logratio.qq_n"
    for k in ("band/n_seq/len_00000_00016", "run/band/n_seq/len_0_16", "fairness/binding_n_bins", "logratio/n",
              "rollout/n_responses", "rollout_corr/n_seq/len_0_16"):
        assert is_count(k) and canonical_key(display_key(k)) == k
    for k in ("band/out_frac/len_0_16", "fairness/lre", "train/skipped_updates", "reward/nonfinite", "val/accuracy"):
        assert not is_count(k) and canonical_key(display_key(k)) == k
    m = {"val/accuracy": 0.5, "fairness/lre": 0.1, "band/out_frac": 0.2, "band/out_frac/len_00000_00016": 0.3,
         "band/n_seq/len_00000_00016": 7.0, "train/loss": 1.0}
    assert headline(m) == {"Headline/1 held-out accuracy": 0.5, "Headline/2 LRE": 0.1,
                           "Headline/3 out-of-band fraction": 0.2,
                           "Headline/5 out-of-band by length len_00000_00016": 0.3}
    assert sorted(["Headline", "band", "clip", "val", "zz counts", "run"]) == \
        ["Headline", "band", "clip", "run", "val", "zz counts"]


def test_fixed_band_scales_are_params_not_metrics():
    """The fixed band's c_* are its settings (params clip/c_*); the EMA band's move with sigma_hat."""
    from fspo.clipping.fspo import FSPOClip

    assert set(FSPOClip(band="fixed").extra_metrics()) == {"clip/sigma_hat", "clip/kl_bar"}
    ema = FSPOClip(band="ema", z=2.0).extra_metrics()
    assert ema["clip/c_upper"] == pytest.approx(2.0 * ema["clip/sigma_hat"])


def test_default_run_name_from_method_model_seed_and_time():
    t = 1795947125.0  # 2026-11-23 06:12:05 UTC
    name = default_run_name("fspo", "tiny", 1, now=t)
    local = __import__("time").localtime(t)
    assert name == f"fspo-tiny-s1-{local.tm_mon:02d}{local.tm_mday:02d}-{local.tm_hour:02d}{local.tm_min:02d}05"
    assert default_run_name("fspo", "tiny", 1, now=t + 1) != name


def test_experiment_description_set_once_never_overwritten(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'm.db'}"
    client = MlflowClient(tracking_uri=uri)
    assert describe_experiment(uri, "absent") is False  # not created yet: nothing to describe
    a = client.create_experiment("a", artifact_location=str(tmp_path / "art"))
    assert describe_experiment(uri, "a") is True
    assert client.get_experiment(a).tags[NOTE_TAG] == EXPERIMENT_NOTE
    client.set_experiment_tag(a, NOTE_TAG, "my own words")
    assert describe_experiment(uri, "a") is False
    assert client.get_experiment(a).tags[NOTE_TAG] == "my own words"


def test_lre_by_step_figure_draws_what_was_logged():
    fig = lre_by_step_figure({"fairness/lre": ([1, 2, 3], [0.1, 0.05, 0.02]), "clip/seq_frac": ([1, 2], [0.2, 0.1])})
    top, bottom = fig.axes
    assert [tuple(line.get_xdata()) for line in top.lines] == [(1, 2, 3)]
    assert [tuple(line.get_ydata()) for line in bottom.lines] == [(0.2, 0.1)]
    empty = lre_by_step_figure({})
    assert all(not ax.lines and ax.texts[0].get_text() == "not logged in this run" for ax in empty.axes)


@pytest.mark.slow
def test_two_tiny_runs_layout(tmp_path, tiny_run):
    """Two launches of the same command: distinct names, <= MAX_SECTIONS sections, settings as params,
    the experiment described once (a user's description survives), figures logged, report reads it. The first
    launch is conftest's shared `tiny_run`; the second goes into a copy of its store."""
    from mlflow.tracking import MlflowClient

    from conftest import tiny_run_command, tiny_run_env
    from fspo.evaluation.report.collect import load_runs

    first = (tiny_run["out"] / "mlflow_run_id").read_text().strip()
    shutil.copyfile(tiny_run["store"], tmp_path / "store.db")  # the shared store stays as the run left it
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'store.db'}")
    exp = client.get_experiment_by_name("fspo")
    assert exp.tags[NOTE_TAG] == EXPERIMENT_NOTE
    client.set_experiment_tag(exp.experiment_id, NOTE_TAG, "user text")
    proc = subprocess.run(tiny_run_command(tmp_path, tmp_path / "run2", tmp_path / "artifacts"), cwd=tmp_path,
                          env=tiny_run_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    second = (tmp_path / "run2" / "mlflow_run_id").read_text().strip()
    assert client.get_experiment_by_name("fspo").tags[NOTE_TAG] == "user text"

    runs = [client.get_run(r) for r in (first, second)]
    names = [r.info.run_name for r in runs]
    assert all(NAME_RE.match(n) for n in names) and names[0] != names[1], names
    run = runs[0]
    metrics, params = run.data.metrics, run.data.params
    assert not set(CONSTANT_SETTINGS) & set(metrics)
    assert {"clip/c_upper", "clip/c_lower", "clip/c_dual", "ppo/lr", "clip/band", "method"} <= set(params)
    assert params["clip/c_upper"] == "0.03" and params["clip/band"] == "fixed"
    sections = {section(k) for k in metrics}
    assert {"val", "train", "clip", "band", "run"} <= sections and len(sections) <= MAX_SECTIONS, sorted(sections)
    order = sorted(sections)  # MLflow's order (plain code-unit sort): the headline first, the counts last
    assert order[0] == "Headline" and order[-1] == "zz counts", order
    assert {"Headline/1 held-out accuracy", "Headline/2 LRE", "Headline/3 out-of-band fraction"} <= set(metrics)
    assert any(k.startswith("Headline/5 out-of-band by length len_") for k in metrics)
    assert metrics["Headline/1 held-out accuracy"] == metrics["val/accuracy"]
    assert not [k for k in metrics if "n_seq" in k and not k.startswith("zz counts/")]
    assert any(k.startswith("clip/seq_frac.len_") for k in metrics)  # per-bin series inside `clip`
    assert any(k.startswith("run/clip.seq_frac.len_") for k in metrics)
    # the run's length law: std(S_L) ~ c L^gamma over its length bins, and the Q-Q R^2
    assert {"run/logratio.std_exponent", "run/logratio.std_exponent_r2", "run/logratio.qq_r2"} <= set(metrics)
    plots = {a.path for a in client.list_artifacts(first, "plots")}
    assert {"plots/lre_by_step.png", "plots/clip_fraction_by_length.png"} <= plots

    recs = {r.run_id: r for r in load_runs(client, ["fspo"])}
    rec = recs[first]
    assert rec.clip_by_length() and all(k.startswith("len_") for k in rec.clip_by_length())
    assert rec.clip_by_length() == {k[len("run/clip.seq_frac."):]: v for k, v in metrics.items()
                                    if k.startswith("run/clip.seq_frac.len_")}
