"""Run infrastructure: what keeps a run alive, resumable and safe, whatever the method. Subpackages, imports
pointing one way: launch (ranks, devices, FSDP, memory plan) <- checkpoints <- checks (up-front checks, errors).
"""
