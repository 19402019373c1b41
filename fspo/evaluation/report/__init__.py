"""The sweep report (paper Table 1, length-fairness diagnostics and figures) built from MLflow runs; command
line: experiments/report.py.
"""
from fspo.evaluation.report.build import make_report
from fspo.evaluation.report.collect import RunRecord, load_runs
from fspo.evaluation.report.table import fairness_rows, group_runs, table1

__all__ = ["make_report", "RunRecord", "load_runs", "group_runs", "table1", "fairness_rows"]
