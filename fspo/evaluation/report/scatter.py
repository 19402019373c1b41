"""The paper's Figure 1 (left): S_L against L with the mean +- 2 std band per length bin, one panel per group,
from each run's ``logratio_samples.csv`` (a uniform sample of its (L_i, S_i)). Bins hold equal counts of the
pooled sample (``n_bins``; ties kept together); per bin the mean and sample std (m >= 2), drawn at its mean
length. Under the sqrt law the band fans out like sqrt(L) (dashed: the group's sigma_hat).
"""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence

import numpy as np
from matplotlib.figure import Figure

from fspo.evaluation.report.collect import read_artifact
from fspo.tracking.artifacts import SAMPLES_FILE


def download_samples(tracking_uri: str, runs) -> Optional[np.ndarray]:
    """The pooled [n, 2] (L, S) samples of ``runs``; runs without the file are skipped (logged)."""
    def load(p: Path) -> np.ndarray:
        return np.loadtxt(p, delimiter=",", skiprows=1, ndmin=2)
    parts = [read_artifact(tracking_uri, r, SAMPLES_FILE, load) for r in runs]  # older runs have none
    parts = [p for p in parts if p is not None and p.size]
    return np.concatenate(parts) if parts else None


def band_rows(samples: np.ndarray, n_bins: int = 10) -> List[Dict[str, float]]:
    """Per equal-count length bin: ``len_lo``, ``len_hi``, ``mean_len``, ``n``, ``mean``, ``std``."""
    L, S = samples[:, 0], samples[:, 1]
    order = np.argsort(L, kind="stable")
    L, S = L[order], S[order]
    cuts = sorted(set(int(round(i * len(L) / n_bins)) for i in range(n_bins + 1)))
    rows = []
    start = 0
    for end in cuts[1:]:
        while end < len(L) and end > 0 and L[end] == L[end - 1]:  # keep equal lengths in one bin
            end += 1
        if end <= start:
            continue
        s = S[start:end]
        rows.append({"len_lo": float(L[start]), "len_hi": float(L[end - 1]), "mean_len": float(L[start:end].mean()),
                     "n": int(end - start), "mean": float(s.mean()),
                     "std": float(s.std(ddof=1)) if len(s) > 1 else float("nan")})
        start = end
    return rows


def scatter_figure(samples_by_group: Mapping[str, np.ndarray], sigma_by_group: Mapping[str, Optional[float]],
                   n_bins: int = 10) -> Figure:
    """Figure 1 (left): one panel per group, S_L against L with the per-bin mean +- 2 std band."""
    n = max(len(samples_by_group), 1)
    ncols = min(n, 3)
    nrows = -(-n // ncols)
    fig = Figure(figsize=(4.6 * ncols, 3.8 * nrows), layout="constrained")
    axes = np.atleast_1d(fig.subplots(nrows, ncols, squeeze=False)).ravel()
    for ax, (group, xs) in zip(axes, samples_by_group.items()):
        ax.scatter(xs[:, 0], xs[:, 1], s=3, alpha=0.25, color="tab:gray", rasterized=True)
        rows = [r for r in band_rows(xs, n_bins) if np.isfinite(r["std"])]
        if rows:
            x = np.array([r["mean_len"] for r in rows])
            mu, sd = np.array([r["mean"] for r in rows]), np.array([r["std"] for r in rows])
            ax.plot(x, mu, "o-", color="tab:blue", label="mean per bin")
            ax.fill_between(x, mu - 2 * sd, mu + 2 * sd, color="tab:blue", alpha=0.2, label="mean +- 2 std")
        sigma = sigma_by_group.get(group)
        if sigma:
            grid = np.linspace(max(xs[:, 0].min(), 1.0), xs[:, 0].max(), 100)
            ax.plot(grid, 2 * sigma * np.sqrt(grid), "k--", lw=1, label="+- 2 sigma_hat sqrt(L)")
            ax.plot(grid, -2 * sigma * np.sqrt(grid), "k--", lw=1)
        ax.set(title=f"{group} (n = {len(xs)})", xlabel="response length L (tokens)", ylabel="S_L = sum_t log ratio")
        ax.legend(fontsize=7, loc="best")
    for ax in axes[n:]:
        ax.set_visible(False)
    return fig


def write_scatter(tracking_uri: str, groups: Mapping[str, Sequence], sigma_by_group: Mapping[str, Optional[float]],
                  out: Path, n_bins: int = 10) -> Optional[Figure]:
    """``out/sl_band.csv`` (group, bin rows) and the figure (None when no run logged samples)."""
    import csv

    pooled = {g: s for g, rs in groups.items() if (s := download_samples(tracking_uri, rs)) is not None}
    if not pooled:
        return None
    with open(Path(out) / "sl_band.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["group", "len_lo", "len_hi", "mean_len", "n", "mean", "std"])
        w.writeheader()
        for g, s in pooled.items():
            for r in band_rows(s, n_bins):
                w.writerow({"group": g, **r})
    return scatter_figure(pooled, sigma_by_group, n_bins)
