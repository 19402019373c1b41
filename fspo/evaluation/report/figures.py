"""The report's figures (matplotlib's `Figure`, no pyplot). Theory curves rebuild the clip rule from the run's
``clip/*`` params and draw its ``theory_clip_fraction(L, sigma)`` with sigma the group's mean
``run/logratio/sigma_hat`` (FSPO's EMA band: the stationary 2 Phi(-z)).
"""
from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence

import numpy as np
import yaml
from matplotlib.figure import Figure

from fspo.diagnostics.bins import bin_midpoint as _bin_mid
from fspo.diagnostics.plots import plot_clip_fraction_by_length
from fspo.evaluation.report.by_length import MIN_COUNT, flatness, group_by_length
from fspo.evaluation.report.collect import RunRecord
from fspo.evaluation.report.table import mean_std

log = logging.getLogger(__name__)
Groups = Mapping[str, Sequence[RunRecord]]
RUN_STD_PREFIX = "run/logratio/std/"  # std(S_L) per length bin, run level


def safe_name(s: str) -> str:
    """A file-name-safe version of a group label."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", s).strip("_") or "group"


def _figure(ncols: int = 1, size=(6.4, 4.4)) -> tuple:
    fig = Figure(figsize=(size[0] * ncols, size[1]), dpi=100)
    return fig, [fig.add_subplot(1, ncols, i + 1) for i in range(ncols)]


def _parse(v: str):
    if v == "None":
        return None
    try:
        return yaml.safe_load(v)
    except yaml.YAMLError:
        return v


def theory_curve(params: Mapping[str, str], sigma: Optional[float]) -> Optional[Callable]:
    """c(L) for the rule in ``params`` (flattened ``clip/*``), or None (no closed form, no sigma)."""
    from fspo.clipping.theory import c_fspo

    clip = {k[5:]: _parse(v) for k, v in params.items() if k.startswith("clip/") and k.count("/") == 1}
    if "target" not in clip or not sigma or sigma <= 0:
        return None
    if clip.get("band") == "ema" and clip.get("z"):
        z = float(clip["z"])
        return lambda L: c_fspo(L, z=z)
    try:
        from hydra.utils import instantiate

        rule = instantiate({"_target_": clip.pop("target"), **clip})
        if rule.theory_clip_fraction(np.array([1.0]), sigma) is None:
            return None
        return lambda L: rule.theory_clip_fraction(np.asarray(L, dtype=float), sigma)
    except Exception as e:  # noqa: BLE001 - a figure without theory beats no report
        log.warning("no theory curve for clip params %s: %s", clip, e)
        return None


def group_clip_by_length(runs: Sequence[RunRecord], out_of_band: bool = False) -> Dict[str, float]:
    """Per length bin, the mean over runs of the binding-clip fraction, or with ``out_of_band`` of c(L) (runs lacking
    a bin left out of its mean)."""
    per_bin: Dict[str, List[float]] = {}
    for r in runs:
        for k, v in (r.out_of_band_by_length() if out_of_band else r.clip_by_length()).items():
            per_bin.setdefault(k, []).append(v)
    return {k: float(np.mean(v)) for k, v in sorted(per_bin.items())}


def group_sigma(runs: Sequence[RunRecord]) -> Optional[float]:
    """Mean over runs of ``run/logratio/sigma_hat`` (else the last step's)."""
    return mean_std([r.metrics.get("run/logratio/sigma_hat", r.metrics.get("logratio/sigma_hat")) for r in runs])[0]


def clip_by_length_figures(groups: Groups) -> Dict[str, Figure]:
    """``clip_fraction_by_length`` (every group's c(L) and theory) and one figure per group adding the binding-clip
    fraction (dotted); runs without the out-of-band keys show only their binding curve."""
    observed, theory, out = {}, {}, {}
    for g, runs in groups.items():
        obs = group_clip_by_length(runs, out_of_band=True)
        bind = group_clip_by_length(runs)
        sigma = group_sigma(runs)
        cur = theory_curve(runs[0].params, sigma) if runs else None
        if obs:
            observed[g] = obs
        th = {f"{g} theory (sigma={sigma:.3g})": cur} if cur is not None else None
        if th:
            theory.update(th)
        out[f"clip_fraction_by_length_{safe_name(g)}"] = plot_clip_fraction_by_length(
            {f"{g} out of band": obs} if obs else ([], []), th,
            title=f"Out-of-band fraction c(L) = 1 - q(L) by length: {g}",
            binding={f"{g} (binding clip)": bind} if bind else None)
    fig = plot_clip_fraction_by_length(observed or ([], []), theory or None,
                                       title="Observed out-of-band fraction c(L) by length (dashed: theory)")
    _match_colors(fig, list(groups))
    out["clip_fraction_by_length"] = fig
    return out


def clip_by_length_grid(groups: Groups, min_count: float = MIN_COUNT) -> Figure:
    """One panel per group, shared axes: c(L) (hollow: bins under ``min_count`` sequences per run), theory (dashed),
    binding clips (dotted); titled with the group's LRE and max - min of c(L)."""
    n = max(len(groups), 1)
    ncols = min(4, n)
    nrows = (n + ncols - 1) // ncols
    fig = Figure(figsize=(3.6 * ncols, 3.0 * nrows + 0.5), dpi=100)
    axes = fig.subplots(nrows, ncols, sharex=True, sharey=True, squeeze=False).ravel()
    xmax = 1.0
    for i, (g, runs) in enumerate(groups.items()):
        ax = axes[i]
        cells = group_by_length(runs)
        pts = [(_bin_mid(b), c, n is None or n >= min_count) for b, (c, n) in cells.items()]
        if pts:
            xmax = max(xmax, max(x for x, _, _ in pts))
            ax.plot([x for x, _, _ in pts], [c for _, c, _ in pts], "-", color="C0", lw=1)
            full = [(x, c) for x, c, ok in pts if ok]
            thin = [(x, c) for x, c, ok in pts if not ok]
            if full:
                ax.plot(*zip(*full), "o", color="C0", ms=4, label="c(L) = 1 - q(L)")
            if thin:
                ax.plot(*zip(*thin), "o", mfc="none", color="C0", ms=4, label=f"thin bin (n < {min_count:g})")
        bind = group_clip_by_length(runs)
        if bind:
            ax.plot([_bin_mid(b) for b in bind], list(bind.values()), "s:", color="C2", ms=2, lw=1,
                    label="binding clip")
        cur = theory_curve(runs[0].params, group_sigma(runs)) if runs else None
        if cur is not None:
            grid = np.linspace(1.0, 250.0 if xmax < 250 else xmax * 1.05, 300)
            ax.plot(grid, cur(grid), "--", color="C3", lw=1.2, label="theory (Gaussian)")
        flat, npop = flatness(cells, min_count)
        lre = mean_std([r.metrics.get("run/fairness/lre") for r in runs])[0]
        spread = f"max-min {flat:.2f} ({npop} bins)" if flat is not None else \
            f"max-min: too few bins ({npop} with n >= {min_count:g})"
        ax.set_title(f"{g}\nLRE {'-' if lre is None else f'{lre:.3f}'}, {spread}", fontsize=9)
        ax.grid(alpha=0.3)
        if i == 0:
            ax.legend(fontsize=7)
    for ax in axes[len(groups):]:
        ax.axis("off")
    for ax in axes:
        ax.set_ylim(bottom=0)
    for ax in axes[(nrows - 1) * ncols:]:
        ax.set_xlabel("response length L")
    for ax in axes[::ncols]:
        ax.set_ylabel("out of band")
    fig.suptitle("Out-of-band fraction c(L) by response length, one panel per group")
    fig.tight_layout()
    return fig


def std_vs_sqrt_len_figure(groups: Groups) -> Figure:
    """std(S_L) per bin against sqrt(L), one line per group with its log-log exponent, and sigma sqrt(L) for the
    mean sigma_hat (dashed)."""
    fig, (ax,) = _figure()
    sig = []
    for i, (g, runs) in enumerate(groups.items()):
        per: Dict[str, List[float]] = {}
        for r in runs:
            for k, v in r.metrics.items():
                if k.startswith(RUN_STD_PREFIX) and v > 0:
                    per.setdefault(k[len(RUN_STD_PREFIX):], []).append(v)
        sig += [r.metrics["run/logratio/sigma_hat"] for r in runs if "run/logratio/sigma_hat" in r.metrics]
        if not per:
            continue
        x = np.array([_bin_mid(b) for b in sorted(per)])
        y = np.array([np.mean(per[b]) for b in sorted(per)])
        slope = np.polyfit(np.log(x), np.log(y), 1)[0] if len(x) >= 2 else float("nan")
        ax.plot(np.sqrt(x), y, "o-", ms=3, lw=1, color=f"C{i % 10}", label=f"{g} (exponent {slope:.2f})")
    if sig:
        g = np.linspace(0.0, ax.get_xlim()[1], 50)
        s = float(np.mean(sig))
        ax.plot(g, s * g, "k--", lw=1.2, label=f"sigma sqrt(L), sigma = {s:.3f}")
    ax.set(xlabel="sqrt(L)", ylabel="std(S_L)", title="std of the sequence log-ratio by length (paper: sigma sqrt(L))")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _match_colors(fig: Figure, groups: Sequence[str]) -> None:
    """One colour per group for its observed and theory lines."""
    ax = fig.axes[0]
    for line in ax.get_lines():
        label = line.get_label()
        for i, g in enumerate(groups):
            if label == g or label.startswith(f"{g} theory"):
                line.set_color(f"C{i % 10}")
    if ax.get_legend() is not None:
        ax.legend(fontsize=8)


def lre_figure(groups: Groups) -> Figure:
    """Bars of mean ``run/fairness/lre`` and ``lre_w`` per group, std over runs, runs as dots."""
    fig, (ax,) = _figure(size=(max(5.0, 1.3 * len(groups) + 2), 4.2))
    x = np.arange(len(groups))
    for j, (key, lab) in enumerate((("run/fairness/lre", "LRE"), ("run/fairness/lre_w", "LRE_w"))):
        means, errs = [], []
        for i, runs in enumerate(groups.values()):
            vals = [r.metrics[key] for r in runs if key in r.metrics]
            m, s, _ = mean_std(vals)
            means.append(m or 0.0)
            errs.append(s or 0.0)
            ax.plot([i + (j - 0.5) * 0.38] * len(vals), vals, "k.", ms=4)
        ax.bar(x + (j - 0.5) * 0.38, means, 0.38, yerr=errs, capsize=3, label=lab, alpha=0.8)
    ax.set_xticks(x, list(groups), rotation=20)
    ax.set(ylabel="length reweighting error", title="LRE per method (lower is fairer; dots: runs)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def _plot_mean_curves(ax, groups: Groups, key: str, ylabel: str) -> None:
    for i, (g, runs) in enumerate(groups.items()):
        color = f"C{i % 10}"
        by_step: Dict[int, List[float]] = {}
        for r in runs:
            h = r.history.get(key, [])
            if h:
                ax.plot([s for s, _ in h], [v for _, v in h], "-", color=color, lw=0.6, alpha=0.3)
            for s, v in h:
                by_step.setdefault(s, []).append(v)
        if by_step:
            steps = sorted(by_step)
            ax.plot(steps, [np.mean(by_step[s]) for s in steps], "-", color=color, lw=1.8, label=f"{g} (n={len(runs)})")
    ax.set(xlabel="RL step", ylabel=ylabel)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def learning_curves_figure(groups: Groups) -> Figure:
    """``reward/mean``, ``rollout/response_len_mean``, ``val/accuracy`` by step (thin: runs, thick: mean)."""
    fig, axes = _figure(3, size=(5.0, 4.0))
    curves = (("reward/mean", "mean reward"), ("rollout/response_len_mean", "mean response length"),
              ("val/accuracy", "validation accuracy"))
    for ax, (key, lab) in zip(axes, curves):
        _plot_mean_curves(ax, groups, key, lab)
        ax.set_title(key)
    fig.tight_layout()
    return fig


def overlong_figure(groups: Groups) -> Figure:
    """``rollout/overlong_rate`` by step, per group."""
    fig, (ax,) = _figure()
    _plot_mean_curves(ax, groups, "rollout/overlong_rate", "overlong rate")
    ax.set_title("Overlong rate")
    fig.tight_layout()
    return fig


def image_grid_figure(images: Mapping[str, Path], title: str, ncols: int = 4) -> Figure:
    """Tile PNG files in a grid titled by their keys."""
    import matplotlib.image as mpimg

    n = max(len(images), 1)
    ncols = min(ncols, n)
    nrows = (n + ncols - 1) // ncols
    fig = Figure(figsize=(4.0 * ncols, 4.0 * nrows + 0.4), dpi=100)
    for i, (name, path) in enumerate(images.items()):
        ax = fig.add_subplot(nrows, ncols, i + 1)
        ax.imshow(mpimg.imread(str(path)))
        ax.set_title(name, fontsize=9)
        ax.axis("off")
    if not images:
        fig.text(0.5, 0.5, "no images", ha="center")
    fig.suptitle(title)
    fig.tight_layout()
    return fig
