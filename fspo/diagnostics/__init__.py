"""Length-fairness diagnostics (paper section "Length-Fairness Diagnostics"; docs/metrics.md): `FairnessMetrics`."""
from fspo.clipping.theory import (
    c_fspo,
    c_fspo_symmetric,
    c_gspo,
    c_gspo_symmetric,
    c_rloo,
    c_rloo_symmetric,
)
from fspo.diagnostics.bins import LengthBins, check_finite, label_edges
from fspo.diagnostics.clip_fraction import ClipFractionByLength
from fspo.diagnostics.collection import METRIC_NAME_RE, FairnessMetrics, check_metric_names
from fspo.diagnostics.lengths import RolloutLengthStats
from fspo.diagnostics.log_ratio import LogRatioStats, normal_quantiles
from fspo.diagnostics.lre import acceptance, length_fairness, lre, min_len_mask, q_bar
from fspo.diagnostics.plots import plot_clip_fraction_by_length, plot_qq, plot_std_vs_sqrt_len

__all__ = [
    "LengthBins", "label_edges", "check_finite",
    "ClipFractionByLength", "LogRatioStats", "RolloutLengthStats", "FairnessMetrics",
    "METRIC_NAME_RE", "check_metric_names", "normal_quantiles",
    "acceptance", "lre", "q_bar", "min_len_mask", "length_fairness",
    "c_rloo", "c_gspo", "c_fspo", "c_rloo_symmetric", "c_gspo_symmetric", "c_fspo_symmetric",
    "plot_clip_fraction_by_length", "plot_qq", "plot_std_vs_sqrt_len",
]
