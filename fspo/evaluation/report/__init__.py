"""The sweep report (paper Table 1, length-fairness diagnostics and figures) built from MLflow runs.

Owns: collect.py (runs -> `RunRecord`), table.py (Table 1, fairness summary, CSV/Markdown),
figures.py (clip fraction by length with theory, LRE, learning curves, overlong rate, Q-Q grid),
build.py (`make_report`: the folder and the ``report`` MLflow run), difficulty.py (Figure 4 from an
evaluate run), scatter.py (Figure 1: S_L against L). Command line:
experiments/report.py. Leaves out: training and logging the runs (fspo/train.py).
"""
from fspo.evaluation.report.build import make_report
from fspo.evaluation.report.collect import RunRecord, load_runs
from fspo.evaluation.report.table import fairness_rows, group_runs, table1

__all__ = ["make_report", "RunRecord", "load_runs", "group_runs", "table1", "fairness_rows"]
