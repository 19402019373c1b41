"""The update step: one RL step's policy update from a rollout batch (`RLModule` in module.py)."""
