"""Checkpoints: writing, reading, verifying, resuming, stopping on a signal. May import fspo.runtime.launch."""
