"""Per-run figures from the run's own MLflow history: LRE and clip fractions against the RL step (whether the
run stayed length-fair all along, not only on the whole-run pool)."""
from __future__ import annotations

from typing import Dict, Sequence, Tuple

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from fspo.diagnostics.metric_keys import display_key

# (panel title, y label, [(metric, legend label)]) ; metrics as the module names them
LRE_BY_STEP: Tuple[Tuple[str, str, Tuple[Tuple[str, str], ...]], ...] = (
    ("Length reweighting error by step", "LRE", (
        ("fairness/lre", "LRE (out of band, the paper's)"), ("fairness/lre_w", "LRE_w (weighted)"),
        ("fairness/binding_lre", "LRE of binding clips"))),
    ("Clip fractions by step", "fraction of sequences", (
        ("band/out_frac", "out of band, c = 1 - q"), ("clip/seq_frac", "binding clip"))),
)


def lre_by_step_figure(series: Dict[str, Tuple[Sequence[int], Sequence[float]]]) -> Figure:
    """Two panels (LRE, clip fractions) against the RL step from ``{metric: (steps, values)}``."""
    fig = Figure(figsize=(7.0, 6.4), dpi=100)
    FigureCanvasAgg(fig)
    for i, (title, ylabel, keys) in enumerate(LRE_BY_STEP):
        ax = fig.add_subplot(len(LRE_BY_STEP), 1, i + 1)
        drawn = 0
        for key, label in keys:
            steps, values = series.get(key, ((), ()))
            if len(steps):
                ax.plot(steps, values, marker="o", ms=3, lw=1.2, label=f"{label} [{key}]")
                drawn += 1
        if not drawn:
            ax.text(0.5, 0.5, "not logged in this run", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("RL step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def run_figures(client, run_id: str) -> Dict[str, Figure]:
    """``{"lre_by_step": Figure}`` from the run's logged history (each metric read under its MLflow key)."""
    series = {}
    for key in (k for _, _, ks in LRE_BY_STEP for k, _ in ks):
        hist = sorted(client.get_metric_history(run_id, display_key(key)), key=lambda m: (m.step, m.timestamp))
        series[key] = ([int(m.step) for m in hist], [float(m.value) for m in hist])
    return {"lre_by_step": lre_by_step_figure(series)}
