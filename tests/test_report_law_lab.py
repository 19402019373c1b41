"""The length-law lab's report (fspo/evaluation/report/law_lab.py) on simulated sweeps: the targets pass when
the law holds exactly and each fails where it should."""
from __future__ import annotations

import math

import numpy as np
import pytest

from fspo.diagnostics import law_bands as lb
from fspo.evaluation.report.law_lab import lab_figure, lab_markdown, lab_rows, targets


def _arm(rng, band, n_prompts=480, g=8, sigma=0.01, knock=False):
    n = np.floor(np.exp(rng.uniform(math.log(4), math.log(101), n_prompts)))
    L = np.repeat(6.0 * n, g)
    sd = sigma * np.sqrt(L) if not knock else sigma * np.sqrt(24.0) * np.ones_like(L)  # knock: std flat in L
    S = rng.normal(0, sd)
    out = lb.outside_of(band, L, S).astype(float) if band is not None else np.zeros_like(L)
    steps = np.repeat(np.arange(n_prompts) // 12, g)
    return {"step": steps, "update": 1 + np.repeat(np.arange(n_prompts) % 3, g),
            "group": np.repeat(np.arange(n_prompts) % 12, g),
            "length": L, "s": S, "d2": sigma ** 2 * L, "adv": np.zeros_like(L), "out": out}


@pytest.fixture(scope="module")
def rows():
    rng = np.random.default_rng(5)
    b = lb.matched_bands(0.01, 120.0)
    recs = {"method=fspo,bands=law": _arm(rng, b["fspo"]), "method=rloo,bands=law": _arm(rng, b["rloo"]),
            "method=gspo,bands=law": _arm(rng, b["gspo"]), "method=measure,bands=panel": _arm(rng, None),
            "method=fspo,bands=knock": _arm(rng, b["fspo"], knock=True)}
    return lab_rows(recs, min_count=50, n_boot=60, own_bands={"method=rloo,bands=law": b["rloo"]})


def test_targets_under_the_law(rows):
    got = {t["target"]: t for t in targets(rows)}
    assert got["FSPO std exponent in [0.4, 0.6]"]["pass"] and got["FSPO std exponent in [0.4, 0.6]"]["ci"][0] < 0.5
    assert got["RLOO c(L) rises >= 3x"]["pass"] and got["GSPO c(L) falls >= 3x"]["pass"]
    assert got["FSPO LRE <= half of min(RLOO, GSPO)"]["pass"]
    assert all(t["pass"] for name, t in got.items() if "span" in name)
    assert got["knock-out std exponent <= 0.25"]["pass"]  # the simulated knock-out has std flat in L


def test_panel_and_gaussian_prediction(rows):
    panel = rows["method=measure,bands=panel"]["panel"]
    assert {"fspo", "rloo", "gspo", "affine", "quantile"} <= set(panel)
    rloo = rows["method=rloo,bands=law"]["own"]
    assert np.allclose(rloo["c_gauss"], rloo["c"], atol=0.08)  # the law holds: the prediction follows


def test_markdown_and_figure(rows, tmp_path):
    md = lab_markdown(rows, targets(rows))
    assert "| FSPO std exponent in [0.4, 0.6] |" in md and "Wilson 95% CI" in md and "panel band **affine**" in md
    lab_figure(rows, "simulated").savefig(tmp_path / "f.png")
    assert (tmp_path / "f.png").stat().st_size > 10_000
