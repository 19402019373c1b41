"""Run infrastructure: what keeps a run alive, resumable and safe, whatever the method. Three subpackages,
imports pointing one way (launch <- checkpoints <- checks; tests/test_architecture.py checks it):

- `fspo.runtime.launch`: where and how the processes run: ranks, devices, FSDP, precision, the memory plan;
- `fspo.runtime.checkpoints`: writing, reading, verifying and resuming checkpoints, and stopping on a signal;
- `fspo.runtime.checks`: the up-front checks of a launch (config, stores, the run lock) and user errors.

Leaves out: the update (fspo/update), generation (fspo/rollout) and the experiment logger (fspo/tracking).
"""
