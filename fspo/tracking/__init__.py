"""Experiment tracking: the loggers a run writes to and what it writes at the end.

Owns: logger.py (building the configured loggers, continuing a resumed MLflow run, exactly-once
metrics), artifacts.py (params, end-of-run diagnostics, figures and config: what is logged), sinks.py
(how each kind of logger, MLflow / TensorBoard / W&B / CSV, stores a figure or a file), sweep_parent.py (the
MLflow parent run of a Hydra sweep) and run_summary.py (the "where are my results" block).
Leaves out: what is measured (fspo/diagnostics, fspo/update/stats.py) and reading runs back for
reports (fspo/evaluation/report).
"""
