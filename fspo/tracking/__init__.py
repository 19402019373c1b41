"""Experiment tracking: the loggers a run writes to and what it writes at the end."""
