"""The sweep report (paper Table 1, length-fairness diagnostics and figures) built from MLflow runs; command
line: experiments/report.py.
"""
