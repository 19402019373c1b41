"""Picking a method: ``+method=<name>`` is the one way, sweep arms are methods plus their own settings, and the
older forms still compose the same config with one deprecation line.

Owns:
- every clip rule in conf/clip/ is a method in conf/method/ of the same name, and ``+method=<rule>`` composes the
  clip and advantage nodes that ``clip=<rule>`` does (the rest differs at most in ``method`` and the aggregation);
- the paper setups in conf/experiment/ pick no part of a method (a setup tier: model, data, batch);
- the sweep arms in sweeps/arm/: each names the method, rule, aggregation and bands the sweeps ran with, and
  differs from its method's config only in the keys the arm file states;
- the deprecation lines of ``clip=<rule>`` and of ``+arm=<arm>`` without ``--config-dir``
  (fspo/runtime/checks/method_aliases.py), and experiments/run.py printing the same config as before with them.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from conftest import CONF, REPO, compose_config
from fspo.runtime.checks import method_aliases
from fspo.runtime.checks.method_aliases import deprecations, legacy_forms
from fspo.sweeps import list_arms
from fspo.sweeps import main as sweeps_main

SWEEPS = REPO / "sweeps"
RULES = sorted(p.stem for p in (CONF / "clip").glob("*.yaml"))
# arm: (method, rule class, loss_agg_mode, tags.bands), as the length sweeps ran them (advantage: grpo for all)
ARMS = {
    "cispo_matched": ("cispo", "CISPOClip", "token-mean", "matched"),
    "ctpo_matched": ("ctpo", "CTPOClip", "token-mean", "matched"),
    "fspo_law": ("fspo", "FSPOClip", "token-mean", "law"),
    "fspo_matched": ("fspo", "FSPOClip", "token-mean", "matched"),
    "fspo_paper": ("fspo", "FSPOClip", "token-mean", "paper"),
    "fspo_per_bin": ("fspo_per_bin", "FSPOClip", "token-mean", "matched"),
    "fspo_power": ("fspo_power", "FSPOClip", "token-mean", "matched"),
    "fspo_quantile": ("fspo_quantile", "FSPOClip", "token-mean", "matched"),
    "gmpo_matched": ("gmpo", "GMPOClip", "seq-mean-token-mean", "matched"),
    "grpo_matched": ("grpo", "GRPOClip", "token-mean", "matched"),
    "grpo_paper": ("grpo", "GRPOClip", "token-mean", "paper"),
    "gspo_law": ("gspo", "GSPOClip", "token-mean", "law"),
    "gspo_matched": ("gspo", "GSPOClip", "seq-mean-token-mean", "matched"),
    "gspo_paper": ("gspo", "GSPOClip", "seq-mean-token-mean", "paper"),
    "knock": ("fspo", "FSPOClip", "token-mean", "knock"),
    "luspo_matched": ("luspo", "LUSPOClip", "seq-mean-token-sum", "matched"),
    "measure": ("measure", "FSPOClip", "token-mean", "panel"),
    "rloo_law": ("rloo", "RLOOClip", "token-mean", "law"),
    "rloo_matched": ("rloo", "RLOOClip", "token-mean", "matched"),
    "rloo_paper": ("rloo", "RLOOClip", "token-mean", "paper"),
    "sapo_matched": ("sapo", "SAPOClip", "seq-mean-token-mean", "matched"),
    "vespo_law": ("vespo", "VESPOClip", "token-mean", "law"),
    "vespo_matched": ("vespo", "VESPOClip", "token-mean", "matched"),
}


def _flat(node, prefix=""):
    """{dotted key: leaf value} of a container (an empty mapping has none)."""
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: node}


def _diff(a, b):
    """Dotted keys whose value differs between two configs (or that one lacks)."""
    fa, fb = _flat(OmegaConf.to_container(a)), _flat(OmegaConf.to_container(b))
    return {k for k in fa.keys() | fb.keys() if fa.get(k, "<absent>") != fb.get(k, "<absent>")}


@pytest.mark.parametrize("rule", RULES)
def test_every_rule_is_a_method_composing_the_same_rule(rule):
    assert (CONF / "method" / f"{rule}.yaml").is_file(), f"conf/clip/{rule}.yaml has no conf/method/{rule}.yaml"
    by_method, by_clip = compose_config([f"+method={rule}"]), compose_config([f"clip={rule}"])
    assert by_method.method == rule
    assert by_method.clip == by_clip.clip and by_method.advantage == by_clip.advantage
    changed = _diff(by_method, by_clip)
    assert changed <= {"method", "loss_agg_mode"}, changed
    if rule.startswith("fspo"):  # the FSPO bands keep FSPO's advantage and aggregation
        assert changed <= {"method"}


@pytest.mark.parametrize("setup", sorted(p.stem for p in (CONF / "experiment").glob("*.yaml")))
def test_paper_setups_pick_no_part_of_a_method(setup):
    node = OmegaConf.load(CONF / "experiment" / f"{setup}.yaml")
    assert not {"method", "clip", "advantage", "loss_agg_mode", "aggregator"} & set(node), setup
    groups = {str(k).split()[-1].lstrip("/") for d in node.get("defaults", []) if OmegaConf.is_dict(d) for k in d}
    assert not {"method", "clip", "advantage"} & groups, setup
    picked = compose_config([f"+experiment={setup}", "+method=gspo"])
    alone = compose_config(["+method=gspo"])
    assert (picked.clip, picked.advantage, picked.loss_agg_mode) == (alone.clip, alone.advantage, alone.loss_agg_mode)


def test_arm_table_names_every_arm(capsys):
    assert list_arms() == sorted(ARMS) == sorted(p.stem for p in (SWEEPS / "arm").glob("*.yaml"))
    assert not (CONF / "arm").exists()  # conf/ holds what a single run picks
    assert sweeps_main(["--help"]) == 0  # python -m fspo.sweeps --help lists them
    usage = capsys.readouterr().out
    assert all(arm in usage for arm in ARMS)


def _stated(arm):
    """Dotted keys the arm file (and the arms it includes) set, method selection aside."""
    node = OmegaConf.load(SWEEPS / "arm" / f"{arm}.yaml")
    keys = {k for k in _flat(OmegaConf.to_container(node)) if not k.startswith("defaults")}
    for entry in node.get("defaults", []):
        if isinstance(entry, str) and entry != "_self_":
            keys |= _stated(entry)
    return keys


@pytest.mark.parametrize("arm", sorted(ARMS))
def test_arm_is_its_method_plus_its_own_settings(arm):
    method, rule, agg, bands = ARMS[arm]
    cfg = compose_config([f"hydra.searchpath=[file://{SWEEPS}]", f"+arm={arm}"])  # run.py --config-dir sweeps
    assert (cfg.method, cfg.clip._target_.rsplit(".", 1)[1], cfg.loss_agg_mode, cfg.tags.bands) == \
        (method, rule, agg, bands)
    assert cfg.advantage._target_ == "fspo.advantages.grpo"
    base = compose_config([f"+method={method if method != 'measure' else 'fspo'}"])
    stated = _stated(arm)
    for key in _diff(cfg, base):  # a key the arm sets, or a node it fills (advantage_mask: null -> {...})
        assert any(s == key or s.startswith(f"{key}.") for s in stated), (arm, key)


def test_clip_selection_names_the_method_form():
    for argv in (["clip=fspo_ema"], ["+clip=fspo_ema", "clip.z=1.5"], ["-m", "clip=fspo,fspo_ema"]):
        (line,) = deprecations(argv)
        rule = argv[-1 if argv[0] == "-m" else 0].partition("=")[2]
        assert f"'+method={rule}'" in line and "next release" in line
    for argv in (["+method=fspo_ema", "clip.z=1.5"], ["clip.c_upper=0.05"], ["++clip=grpo"], []):
        assert deprecations(argv) == []


def test_arm_without_config_dir_gets_the_sweeps_folder(monkeypatch, capsys):
    monkeypatch.setattr(method_aliases, "_SAID", set())
    (line,) = deprecations(["+arm=measure"])
    assert "'--config-dir sweeps'" in line and "sweeps/arm/" in line
    for given in (["--config-dir", "sweeps"], ["--config-dir=sweeps"], ["-cd", "/x"]):
        assert deprecations(["+arm=measure", *given]) == []
        assert legacy_forms(["+arm=measure", *given]) == ["+arm=measure", *given]
    assert legacy_forms(["arm=measure", "steps=2"]) == ["arm=measure", "steps=2", "--config-dir", str(SWEEPS)]
    legacy_forms(["arm=measure", "steps=2"])  # the checks read the command line more than once
    assert capsys.readouterr().err.count("warning: 'arm=measure' without --config-dir") == 1


def _run(*args):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "experiments/run.py", *args, "--cfg", "job"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def test_run_prints_one_deprecation_line_and_the_same_config():
    old, new = _run("clip=fspo_ema"), _run("+method=fspo_ema")
    assert old.returncode == new.returncode == 0, old.stderr[-2000:] + new.stderr[-2000:]
    warnings = [ln for ln in old.stderr.splitlines() if ln.startswith("warning:")]
    assert len(warnings) == 1 and "'+method=fspo_ema'" in warnings[0]
    assert "warning:" not in new.stderr
    # the same config but the method's name
    assert old.stdout.replace("method: fspo\n", "method: fspo_ema\n") == new.stdout
    bare, given = _run("+arm=measure"), _run("--config-dir", "sweeps", "+arm=measure")
    assert bare.returncode == given.returncode == 0, bare.stderr[-2000:] + given.stderr[-2000:]
    assert [ln for ln in bare.stderr.splitlines() if ln.startswith("warning:")] == [
        "warning: " + deprecations(["+arm=measure"])[0]]
    assert bare.stdout == given.stdout and "method: measure" in bare.stdout
