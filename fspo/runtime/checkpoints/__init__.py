"""Checkpoints: writing, reading, verifying, resuming; may import fspo.runtime.launch, never fspo.runtime.checks.

Owns: checkpointing.py (StepCheckpoint: when and how a checkpoint is written, signals, requeue),
files.py (reading checkpoints: where they are, their metadata, the policy weights; the run-id file),
integrity.py (checksums, quarantine), resume.py (which checkpoint and run a launch continues),
resume_state.py (RNG and metric states a checkpoint carries), safe_load.py (loading without unpickling
code), stored_config.py (the _target_ allow-list of a stored config), stop_signal.py (SIGTERM/SIGUSR1
during a step: stop early, save the last completed step) and lora_export.py (LoRA adapters out of a
checkpoint). Leaves out: checking a launch's config and stores (fspo.runtime.checks).
"""
