"""Experiment tracking: the logger a run writes to and what it writes at the end.

Owns: logger.py (building the configured logger, continuing a resumed MLflow run, exactly-once
metrics), artifacts.py (params, end-of-run diagnostics, figures and config), sweep_parent.py (the
MLflow parent run of a Hydra sweep) and run_summary.py (the "where are my results" block).
Leaves out: what is measured (fspo/diagnostics, fspo/update/stats.py) and reading runs back for
reports (fspo/evaluation/report).
"""
