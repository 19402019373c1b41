"""Length fairness: per-length clip fractions of FSPO, RLOO and GSPO against the paper's closed forms.

Data (paper section "Distribution of Sequence-Level Log Ratio"): S_L ~ N(0, sigma^2 L), sigma = 0.03,
for five log-spaced lengths L from 100 to 20,000, N sequences each; per-token log-ratios are S/L so
that the masked sum is S. Counting: every sequence goes through each rule twice, with A = +1 (only
the upper clip can bind) and with A = -1 (the lower clip; the dual clip, which is not part of the
two-sided band, is not counted). The sequence's two-sided clip indicator is upper(A=+1) or
lower(A=-1), i.e. "S outside the band", whose probability is the closed form c(L):

    FSPO  P(S > c_up sqrt L) + P(S < -c_lo sqrt L)                 = 2 Phi(-z), z = c / sigma = 1
    RLOO  P(S > log(1 + eps_hi)) + P(S < log(1 - eps_lo))          ~ 2 Phi(-xi / (sigma sqrt L))
    GSPO  P(S/L > log(1 + eps_hi)) + P(S/L < log(1 - eps_lo))      ~ 2 Phi(-xi sqrt L / sigma)

(the asymmetric forms on the left are the ones asserted). Memory stays bounded by chunking rows.
"""
from __future__ import annotations

import math

import pytest
import torch

from fspo.clipping import FSPOClip, GSPOClip, RLOOClip

SIGMA = 0.03
LENGTHS = [100, 376, 1414, 5318, 20000]  # geomspace(100, 20000, 5), rounded
N_SEQ = 6000  # binomial SE of a fraction <= 0.0065, so the 0.02 tolerance is >= 3 SE
CHUNK_ELEMS = 4_000_000  # at most ~16 MB per [rows, L] float tensor


def phi(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def closed_form(name: str, L: int) -> float:
    sd = SIGMA * math.sqrt(L)
    forms = {
        "fspo": lambda: phi(-0.03 * math.sqrt(L) / sd) + phi(-0.03 * math.sqrt(L) / sd),
        "rloo": lambda: phi(-math.log(1 + 0.667) / sd) + phi(math.log(1 - 0.4) / sd),
        "gspo": lambda: phi(-math.log(1 + 4e-4) * L / sd) + phi(math.log(1 - 3e-4) * L / sd),
    }
    return forms[name]()


RULES = {"fspo": FSPOClip(), "rloo": RLOOClip(), "gspo": GSPOClip()}


@torch.no_grad()
def clip_fraction(rule, s: torch.Tensor, L: int) -> float:
    """Fraction of sequences with S outside the rule's band (upper at A=+1 or lower at A=-1)."""
    rows = max(1, CHUNK_ELEMS // L)
    clipped = 0
    for start in range(0, s.numel(), rows):
        sc = s[start:start + rows]
        n = sc.numel()
        lp = (sc / L)[:, None].expand(n, L)
        old = torch.zeros(1, 1).expand(n, L)
        mask = torch.ones(1, 1).expand(n, L)
        up = rule(lp, old, torch.ones(n), mask).clip_upper[:, 0]
        lo = rule(lp, old, -torch.ones(n), mask).clip_lower[:, 0]
        clipped += int((up | lo).sum())
    return clipped / s.numel()


@pytest.fixture(scope="module")
def fractions():
    gen = torch.Generator().manual_seed(2024)
    out = {name: [] for name in RULES}
    for L in LENGTHS:
        s = torch.randn(N_SEQ, generator=gen) * SIGMA * math.sqrt(L)
        for name, rule in RULES.items():
            out[name].append(clip_fraction(rule, s, L))
    return out


def test_fspo_clip_fraction_is_flat(fractions):
    f = fractions["fspo"]
    assert max(f) - min(f) < 0.03, f
    assert closed_form("fspo", 100) == pytest.approx(2 * phi(-1.0))  # 0.3173
    for L, got in zip(LENGTHS, f):
        assert got == pytest.approx(closed_form("fspo", L), abs=0.02), (L, got)


def test_rloo_clip_fraction_rises_with_length(fractions):
    f = fractions["rloo"]
    assert all(a < b for a, b in zip(f, f[1:])), f
    for L, got in zip(LENGTHS, f):
        assert got == pytest.approx(closed_form("rloo", L), abs=0.02), (L, got)
    assert f[-1] - f[0] > 0.5


def test_gspo_clip_fraction_falls_with_length(fractions):
    f = fractions["gspo"]
    assert all(a > b for a, b in zip(f, f[1:])), f
    for L, got in zip(LENGTHS, f):
        assert got == pytest.approx(closed_form("gspo", L), abs=0.02), (L, got)
    assert f[0] - f[-1] > 0.5


@pytest.mark.parametrize("name", list(RULES))
def test_rules_report_their_closed_form(name, fractions):
    """`ClipRule.theory_clip_fraction` (used for the theory curve in the run's plots) agrees with the
    closed forms above and with the observed fractions."""
    pytest.importorskip("fspo.clipping.theory")
    curve = RULES[name].theory_clip_fraction(LENGTHS, SIGMA)
    for L, c, got in zip(LENGTHS, curve, fractions[name]):
        assert c == pytest.approx(closed_form(name, L), abs=1e-9)
        assert got == pytest.approx(c, abs=0.02)
