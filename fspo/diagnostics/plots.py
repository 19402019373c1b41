"""Diagnostic figures (paper Fig. qL and Fig. seq_ratio_qqplot): matplotlib's object API (a `Figure` saves as PNG
through Agg), never pyplot, so no global state and no display.
"""
from __future__ import annotations

from typing import Callable, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from scipy.special import ndtri

from fspo.diagnostics.bins import bin_midpoint

XY = Tuple[Sequence[float], Sequence[float]]
Curve = Union[Callable[[np.ndarray], np.ndarray], XY]


def _new_figure(size=(6.4, 4.4)) -> Tuple[Figure, Axes]:
    fig = Figure(figsize=size, dpi=100)
    return fig, fig.add_subplot(1, 1, 1)


def _finish(fig: Figure, ax: Axes, xlabel: str, ylabel: str, title: str, loc: str = "best") -> Figure:
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc=loc)
    fig.tight_layout()
    return fig


def _label_xy(d: Mapping[str, float]) -> Tuple[np.ndarray, np.ndarray]:
    """Bin labels -> (bin midpoint, value); the overflow bin is placed at its lower edge."""
    pts = sorted((bin_midpoint(k), float(v)) for k, v in d.items())
    arr = np.asarray(pts, dtype=np.float64).reshape(-1, 2)
    return arr[:, 0], arr[:, 1]


def _series(observed) -> dict:
    """``observed`` as {name: (x, y)}."""
    if isinstance(observed, tuple) and len(observed) == 2:
        return {"observed": (np.asarray(observed[0], float), np.asarray(observed[1], float))}
    if isinstance(observed, Mapping):
        keys = list(observed)
        if all(k.startswith("len_") for k in keys):
            return {"observed": _label_xy(observed)}
        return {name: _series(v)["observed"] for name, v in observed.items()}
    raise ValueError("observed must be {bin label: frac}, (lengths, fracs), or {series name: one of those}")


def plot_clip_fraction_by_length(observed, theory_curve: Union[None, Curve, Mapping[str, Curve]] = None,
                                 title: str = "Out-of-band fraction c(L) = 1 - q(L) by response length",
                                 ylabel: str = "fraction of sequences", binding=None,
                                 counts: Optional[Mapping[str, Sequence[float]]] = None,
                                 note: Optional[str] = None) -> Figure:
    """Observed out-of-band fraction c(L) = 1 - q(L) per length bin beside theory curves, optionally the
    binding-clip fraction dotted. ``observed`` / ``binding``: ``{bin label: frac}`` (at bin midpoints),
    ``(lengths, fracs)``, or ``{series name: either}``; ``theory_curve``: a callable c(L), ``(L, c)`` arrays, or
    ``{name: either}`` (dashed); ``counts``: ``{series name: sequences per point}`` written as ``n=..``; ``note``: a
    caption.
    """
    fig, ax = _new_figure()
    series = _series(observed)
    extra = {} if binding is None else _series(binding)
    xmax = max([float(np.max(x)) for x, _ in list(series.values()) + list(extra.values()) if len(x)] + [1.0])
    for name, (x, y) in series.items():
        ax.plot(x, y, "o-", ms=3, lw=1, label=name)
        for xi, yi, n in zip(x, y, (counts or {}).get(name, ())):
            ax.annotate(f"n={int(n)}", (xi, yi), textcoords="offset points", xytext=(0, 5), ha="center", fontsize=6)
    for name, (x, y) in extra.items():
        ax.plot(x, y, "s:", ms=3, lw=1, label="binding clip" if name == "observed" else name)
    if theory_curve is not None:
        curves = theory_curve if isinstance(theory_curve, Mapping) else {"theory": theory_curve}
        grid = np.linspace(1.0, xmax * 1.05, 400)
        for name, cur in curves.items():
            x, y = (grid, cur(grid)) if callable(cur) else cur
            x, y = np.asarray(x, float), np.asarray(y, float)
            ax.plot(x, y, "--", lw=1.5, label=f"{name}")
    if not any(len(x) for x, _ in list(series.values()) + list(extra.values())):
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    elif theory_curve is not None and (side := _side_of_theory(series, curves)) is not None:
        note = f"{side} {note or ''}".strip()
    ax.margins(y=0.12)  # room for the n= labels
    ax.set_ylim(bottom=0)
    fig = _finish(fig, ax, "response length L (tokens)", ylabel, title)
    if note:
        fig.subplots_adjust(bottom=0.26)
        fig.text(0.01, 0.01, note, fontsize=7, ha="left", va="bottom", wrap=True)
    return fig


def _side_of_theory(series, curves) -> Optional[str]:
    """A caption when every measured point lies on one side of the first theory curve, else None."""
    cur = next(iter(curves.values()))
    pts = [(xi, yi) for x, y in series.values() for xi, yi in zip(x, y) if np.isfinite(yi)]
    if not pts or not callable(cur):
        return None
    below = [yi < float(np.asarray(cur(np.asarray([xi], float)), float).ravel()[0]) for xi, yi in pts]
    if all(below):
        return (f"All {len(pts)} measured points lie below the theory line: the ratios leave the band less often than "
                f"the Gaussian model with sigma_hat predicts (sigma_hat above the spread in these bins, or lighter "
                f"tails than Gaussian); the band is then looser than its target.")
    if not any(below):
        return (f"All {len(pts)} measured points lie above the theory line: the ratios leave the band more often "
                f"than the Gaussian model predicts (heavier tails, or sigma_hat below the spread in these bins).")
    return None


def plot_qq(z_sample: Sequence[float], title: str = "Q-Q plot of standardised S_L") -> Figure:
    """Sorted Z = (S - mu_hat_L) / (sqrt(L) sigma_hat) against Blom quantiles, with the least-squares line (slope,
    intercept, R^2) and y = x."""
    fig, ax = _new_figure((5.0, 5.0))
    z = np.sort(np.asarray(z_sample, dtype=np.float64).ravel())
    z = z[np.isfinite(z)]
    n = z.size
    if n >= 3:
        q = ndtri((np.arange(1, n + 1) - 0.375) / (n + 0.25))
        m, b = np.polyfit(q, z, 1)
        r2 = float(np.corrcoef(q, z)[0, 1] ** 2) if np.std(z) > 0 else 0.0
        ax.plot(q, z, ".", ms=2, alpha=0.6, label=f"data (n={n})")
        ax.plot(q, m * q + b, "-", lw=1.2, label=f"fit m={m:.3f} b={b:.3f} R2={r2:.4f}")
        lim = [min(q[0], z[0]), max(q[-1], z[-1])]
        ax.plot(lim, lim, "k:", lw=1, label="y = x")
    else:
        ax.text(0.5, 0.5, "fewer than 3 samples", ha="center", va="center", transform=ax.transAxes)
    return _finish(fig, ax, "normal quantile", "sample quantile of Z", title, "upper left")


def plot_std_vs_sqrt_len(bin_mean_len: Sequence[float], bin_std: Sequence[float],
                         sigma: Optional[float] = None,
                         title: str = "std(S_L) vs sqrt(L)") -> Figure:
    """Per-bin std(S_L) against sqrt(mean L) (non-finite or non-positive bins skipped); with ``sigma`` the line
    sigma sqrt(L); the legend gives the log-log exponent b of std ~ L^b (theory 0.5)."""
    fig, ax = _new_figure()
    x = np.asarray(bin_mean_len, dtype=np.float64).ravel()
    y = np.asarray(bin_std, dtype=np.float64).ravel()
    ok = np.isfinite(x) & np.isfinite(y) & (x > 0) & (y > 0)
    x, y = x[ok], y[ok]
    if x.size:
        lab = "per-bin std"
        if x.size >= 2 and np.ptp(np.log(x)) > 0:  # the exponent b of std ~ L^b, fitted against L (not sqrt L)
            lab += f": fit std ~ L^{np.polyfit(np.log(x), np.log(y), 1)[0]:.2f} (theory L^0.5)"
        ax.plot(np.sqrt(x), y, "o", ms=3, label=lab)
        if sigma is not None:
            g = np.linspace(0.0, np.sqrt(x.max()) * 1.05, 50)
            ax.plot(g, sigma * g, "--", lw=1.2, label=f"theory sigma sqrt(L) (a straight line here), sigma={sigma:.3g}")
    else:
        ax.text(0.5, 0.5, "no bin with >= 2 samples", ha="center", va="center", transform=ax.transAxes)
    return _finish(fig, ax, "sqrt(mean L)", "std of S_L", title, "upper left")
