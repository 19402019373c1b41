"""Evaluation: scoring checkpoints on benchmarks and reporting sweeps.

Owns: benchmark.py (avg@k on a benchmark with an engine and a verifier), summary.py (best/last per
benchmark, summary.md, the evaluation's MLflow run) and report/ (the sweep report built from MLflow
runs). Leaves out: reading checkpoints (fspo/runtime/checkpoints/files.py) and training.
"""
