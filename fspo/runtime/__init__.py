"""Run infrastructure: what keeps a run alive, resumable and safe, whatever the method.

Owns: distributed.py (data-parallel mesh, FSDP strategy, collectives), rank_zero.py (which process
is rank zero, before and after torch.distributed starts), checkpoint_files.py (reading checkpoints:
where they are, their metadata, the policy weights; the run-id file), checkpointing.py (writing
them), checkpoint_integrity.py (checksums, quarantine), resume_state.py (RNG and metric states a
checkpoint carries), resume.py (which checkpoint and run a launch continues), run_config.py (the
saved config on resume), run_lock.py (one run per output folder), config_check.py (a composed
config's settings checked before anything runs), store_check.py (storage and tracking-store checks)
and errors.py (user errors as one line). Leaves out: the update (fspo/update), generation
(fspo/rollout) and the experiment logger (fspo/tracking).
"""
