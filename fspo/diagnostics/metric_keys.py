"""How metric names are laid out in the MLflow store: one chart section per top-level family.

Owns: `display_key` (our metric name -> the key written to MLflow) and `canonical_key` (a stored key,
old or new layout -> our metric name). Leaves out: which metrics exist (fspo/diagnostics, fspo/update)
and where they are written (fspo/update/metric_logging.py, fspo/tracking/artifacts.py).

MLflow's UI (3.x, run page "Model metrics" and the compare charts) puts a chart in the section named
by its key up to the LAST '/', and orders sections by a plain string sort; the order cannot be set
from a run. Our per-bin series (``clip/seq_frac/len_00016_00032``) and run-level aggregates
(``run/band/out_frac/len_...``) would each open a section of their own (36 for the default run). In
MLflow the key keeps its first '/' and joins the rest with '.', so every family is one section:
``clip/seq_frac.len_00016_00032`` (section ``clip``), ``run/band.out_frac.len_...`` (section ``run``).
Inside a section charts sort by key, so a family's bins stay together. Two sections break the
alphabet on purpose: ``Headline`` first, with copies of held-out accuracy, LRE and the
out-of-band fraction overall and by length (`headline`), and ``zz counts`` last, where sample
counts (``n_seq`` per bin, ``qq_n`` ...) go instead of sitting between the results. Our names hold no '.', so the
mapping is reversible; readers (experiments/report.py) map stored keys back with `canonical_key`,
which leaves keys of runs logged before this layout unchanged.
"""
from __future__ import annotations

import re
from typing import Dict, Mapping

# Sections sort by plain code units (checked in MLflow 3.17: "1 x" < "Headline" < "_x" < "band" < ... < "zz x"),
# so the headline section (uppercase) comes first and the counts section ("zz ...") last.
HEADLINE = "Headline"
COUNTS = "zz counts"
_COUNT_SEG = re.compile(r"^(n|n_\w+|\w+_n|\w*n_bins)$")  # n, n_seq, n_responses, qq_n, binding_n_bins
# our metric -> its chart in the headline section (numbered: charts sort by name inside a section)
HEADLINE_KEYS = {"val/accuracy": "1 held-out accuracy", "fairness/lre": "2 LRE",
                 "band/out_frac": "3 out-of-band fraction", "clip/seq_frac": "4 binding clip fraction"}
HEADLINE_BINS = ("band/out_frac/", "5 out-of-band by length ")  # + the bin label (len_00016_00032)


def is_count(key: str) -> bool:
    """A sample count (``band/n_seq/len_*``, ``logratio/qq_n``, ``run/rollout/n_responses``): it sizes a
    fraction, it is not a result, so its chart goes to the last section."""
    return any(_COUNT_SEG.match(seg) for seg in key.split("/"))


def display_key(key: str) -> str:
    """``a/b/c/d`` -> ``a/b.c.d``; keys with at most one '/' are unchanged; counts (`is_count`) go to the
    last section: ``band/n_seq/len_0_16`` -> ``zz counts/band.n_seq.len_0_16``."""
    if "/" in key and is_count(key):
        return f"{COUNTS}/{key.replace('/', '.')}"
    head, sep, rest = key.partition("/")
    return f"{head}{sep}{rest.replace('/', '.')}" if sep else key


def canonical_key(key: str) -> str:
    """The inverse of `display_key`: ``a/b.c.d`` -> ``a/b/c/d``, ``zz counts/a.b.c`` -> ``a/b/c``; keys with
    no '.' or with more than one '/' (the old layout, ``eval/<benchmark>/avg_at_k``) are unchanged."""
    head, sep, rest = key.partition("/")
    if head == COUNTS and sep:
        return rest.replace(".", "/")
    return f"{head}{sep}{rest.replace('.', '/')}" if sep and "/" not in rest else key


def headline(metrics: Mapping[str, float]) -> Dict[str, float]:
    """The copies shown first on the run page (section ``Headline``): held-out accuracy, LRE, the
    out-of-band and binding-clip fractions, and the out-of-band fraction per length bin. Copies, not
    moves: every metric keeps its own key in its family's section (what report.py reads)."""
    out = {f"{HEADLINE}/{name}": metrics[k] for k, name in HEADLINE_KEYS.items() if k in metrics}
    prefix, name = HEADLINE_BINS
    out.update({f"{HEADLINE}/{name}{k[len(prefix):]}": v for k, v in metrics.items() if k.startswith(prefix)})
    return out
