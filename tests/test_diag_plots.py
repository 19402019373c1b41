"""Each plotting function returns a matplotlib Figure that saves to PNG (Agg, no display)."""
import numpy as np
import pytest
import torch
from matplotlib.figure import Figure

from fspo.clipping.base import ClipResult
from fspo.diagnostics import (
    FairnessMetrics,
    LengthBins,
    c_fspo,
    c_gspo,
    c_rloo,
    plot_clip_fraction_by_length,
    plot_qq,
    plot_std_vs_sqrt_len,
)


def _saves(fig, path):
    assert isinstance(fig, Figure)
    fig.savefig(path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


def test_clip_fraction_plot_inputs(tmp_path):
    by_label = {"len_00000_00200": 0.1, "len_00200_00400": 0.2, "len_32768_inf": 0.4}
    _saves(plot_clip_fraction_by_length(by_label), tmp_path / "a.png")
    theory = {"RLOO": lambda L: c_rloo(L, 0.03, 0.667, 0.4), "GSPO": lambda L: c_gspo(L, 0.03, 4e-4, 3e-4),
              "FSPO": (np.array([1.0, 20000.0]), c_fspo([1.0, 20000.0], z=1.0))}
    series = {"RLOO": by_label, "FSPO": (np.array([100.0, 300.0]), np.array([0.3, 0.31]))}
    _saves(plot_clip_fraction_by_length(series, theory_curve=theory), tmp_path / "b.png")
    _saves(plot_clip_fraction_by_length((np.zeros(0), np.zeros(0))), tmp_path / "c.png")
    fig = plot_clip_fraction_by_length(by_label, binding={"len_00000_00200": 0.05})
    assert [ln.get_label() for ln in fig.axes[0].get_lines()] == ["observed", "binding clip"]
    _saves(fig, tmp_path / "d.png")
    with pytest.raises(ValueError, match="observed"):
        plot_clip_fraction_by_length([0.1, 0.2])


def test_qq_and_std_plots(tmp_path):
    z = np.random.default_rng(0).standard_normal(2000)
    _saves(plot_qq(z), tmp_path / "qq.png")
    _saves(plot_qq([1.0]), tmp_path / "qq_empty.png")  # fewer than 3 samples: annotated, no crash
    L = np.array([100.0, 1000.0, 10000.0])
    _saves(plot_std_vs_sqrt_len(L, 0.03 * np.sqrt(L), sigma=0.03), tmp_path / "std.png")
    _saves(plot_std_vs_sqrt_len([np.nan], [0.0]), tmp_path / "std_empty.png")


def test_fairness_metrics_figures(tmp_path):
    g = torch.Generator().manual_seed(0)
    B, T = 400, 64
    L = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None] < L[:, None]
    up = mask & (torch.rand(B, 1, generator=g) < 0.2)
    no = torch.zeros(B, T, dtype=torch.bool)
    s = torch.randn(B, generator=g) * 0.03 * L.float().sqrt()
    fm = FairnessMetrics(LengthBins(width=16, max_len=64))
    out_band = mask & (torch.rand(B, 1, generator=g) < 0.3)
    fm.update_clip(ClipResult(torch.zeros(1), s, up, no, no, mask & ~out_band), L, mask, torch.ones(B))
    figs = fm.figures(theory={"FSPO z=1": lambda x: c_fspo(x, z=1.0)})
    assert set(figs) == {"clip_fraction_by_length", "logratio_qq", "logratio_std_vs_len"}
    # beside the theory: the out-of-band fraction c(L) = 1 - q(L); the binding clips as a second curve
    lines = {ln.get_label(): ln for ln in figs["clip_fraction_by_length"].axes[0].get_lines()}
    assert set(lines) == {"out of band, c(L) = 1 - q(L)", "binding clip", "FSPO z=1"}
    per_bin = fm.clip.last_per_bin
    ok = per_bin["band_count"] >= fm.figure_min_count  # 20 by default: sparser bins are not drawn
    assert 0 < ok.sum() < (per_bin["band_count"] > 0).sum()  # here: the overflow bin (L = 64) has 5
    np.testing.assert_allclose(lines["out of band, c(L) = 1 - q(L)"].get_ydata(), per_bin["out_frac"][ok])
    np.testing.assert_allclose(lines["binding clip"].get_ydata(), per_bin["seq_frac"][per_bin["count"] >= 20])
    assert not np.allclose(per_bin["out_frac"][ok], per_bin["seq_frac"][ok])
    ax = figs["clip_fraction_by_length"].axes[0]
    assert [t.get_text() for t in ax.texts] == [f"n={int(n)}" for n in per_bin["band_count"][ok]]
    for name, fig in figs.items():
        _saves(fig, tmp_path / f"{name}.png")
    # bins with fewer than figure_min_count sequences are not drawn (not as 0) and the caption says so
    sparse = FairnessMetrics(LengthBins(width=16, max_len=64), figure_min_count=int(per_bin["band_count"].max()))
    sparse.update_clip(ClipResult(torch.zeros(1), s, up, no, no, mask & ~out_band), L, mask, torch.ones(B))
    fig = sparse.figures()["clip_fraction_by_length"]
    drawn = {ln.get_label(): ln for ln in fig.axes[0].get_lines()}["out of band, c(L) = 1 - q(L)"].get_ydata()
    assert len(drawn) == (per_bin["band_count"] >= per_bin["band_count"].max()).sum() < ok.sum()
    hidden = int((per_bin["band_count"] > 0).sum()) - len(drawn)
    most = int(per_bin['band_count'].max())
    assert f"{hidden} bin(s) with fewer than {most} sequences not drawn" in fig.texts[0].get_text()
    fm.reset()
    for name, fig in fm.figures().items():  # empty state: placeholder figures, no crash
        _saves(fig, tmp_path / f"empty_{name}.png")
