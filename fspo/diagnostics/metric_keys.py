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
Inside a section charts sort by key, so a family's bins stay together. Our names hold no '.', so the
mapping is reversible; readers (experiments/report.py) map stored keys back with `canonical_key`,
which leaves keys of runs logged before this layout unchanged.
"""
from __future__ import annotations


def display_key(key: str) -> str:
    """``a/b/c/d`` -> ``a/b.c.d``; keys with at most one '/' are unchanged."""
    head, sep, rest = key.partition("/")
    return f"{head}{sep}{rest.replace('/', '.')}" if sep else key


def canonical_key(key: str) -> str:
    """The inverse of `display_key`: ``a/b.c.d`` -> ``a/b/c/d``; keys with no '.' or with more than one
    '/' (the old layout, ``eval/<benchmark>/avg_at_k``) are unchanged."""
    head, sep, rest = key.partition("/")
    return f"{head}{sep}{rest.replace('.', '/')}" if sep and "/" not in rest else key
