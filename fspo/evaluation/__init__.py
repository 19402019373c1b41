"""Evaluation: scoring checkpoints on benchmarks (benchmark.py, summary.py) and the sweep report (report/)."""
