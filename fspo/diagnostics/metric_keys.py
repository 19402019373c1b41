"""Metric names in the MLflow store: one chart section per top-level family. MLflow's UI sections charts by the
key up to its LAST '/' and sorts sections as plain strings, so `display_key` keeps the first '/' and joins the
rest with '.' (``clip/seq_frac.len_00016_00032``); ``Headline`` sorts first (copies of the headline numbers)
and ``zz counts`` last (sample counts). Our names hold no '.', so `canonical_key` maps stored keys back (keys
of the old layout unchanged).
"""
from __future__ import annotations

import re
from typing import Dict, Mapping

# sections sort by code units (MLflow 3.17): uppercase first, "zz ..." last
HEADLINE = "Headline"
COUNTS = "zz counts"
_COUNT_SEG = re.compile(r"^(n|n_\w+|\w+_n|\w*n_bins)$")  # n, n_seq, n_responses, qq_n, binding_n_bins
# our metric -> its chart in the headline section (numbered: charts sort by name inside a section)
HEADLINE_KEYS = {"val/accuracy": "1 held-out accuracy", "fairness/lre": "2 LRE",
                 "band/out_frac": "3 out-of-band fraction", "clip/seq_frac": "4 binding clip fraction"}
HEADLINE_BINS = ("band/out_frac/", "5 out-of-band by length ")  # + the bin label (len_00016_00032)


def is_count(key: str) -> bool:
    """A sample count (``band/n_seq/len_*``, ``logratio/qq_n``, ...): its chart goes to the last section."""
    return any(_COUNT_SEG.match(seg) for seg in key.split("/"))


def display_key(key: str) -> str:
    """``a/b/c/d`` -> ``a/b.c.d``; counts to ``zz counts/a.b.c.d``; keys with at most one '/' unchanged."""
    if "/" in key and is_count(key):
        return f"{COUNTS}/{key.replace('/', '.')}"
    head, sep, rest = key.partition("/")
    return f"{head}{sep}{rest.replace('/', '.')}" if sep else key


def canonical_key(key: str) -> str:
    """The inverse of `display_key`; keys with no '.' or more than one '/' (the old layout) unchanged."""
    head, sep, rest = key.partition("/")
    if head == COUNTS and sep:
        return rest.replace(".", "/")
    return f"{head}{sep}{rest.replace('.', '/')}" if sep and "/" not in rest else key


def headline(metrics: Mapping[str, float]) -> Dict[str, float]:
    """Copies (not moves) shown first on the run page: held-out accuracy, LRE, the out-of-band and binding-clip
    fractions, and the out-of-band fraction per length bin."""
    out = {f"{HEADLINE}/{name}": metrics[k] for k, name in HEADLINE_KEYS.items() if k in metrics}
    prefix, name = HEADLINE_BINS
    out.update({f"{HEADLINE}/{name}{k[len(prefix):]}": v for k, v in metrics.items() if k.startswith(prefix)})
    return out
