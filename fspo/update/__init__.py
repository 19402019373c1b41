"""The update step: one RL step's policy update from a rollout batch.

Owns: module.py (`RLModule`, the LightningModule: old log-probs -> mini/micro-batches -> clip ->
aggregate -> optimizer step), settings.py (`PPOConfig`), forward.py (the policy's forward passes
and micro-batch layouts), logprobs.py (per-token log-probs of sampled responses), packing.py
(packed layouts), microbatches.py (mini-batch plans and token-budget micro-batches), guard.py (the
divergence guard), stats.py (per-step loss/KL/entropy/grad-norm statistics) and metric_logging.py
(where a step's metrics go). Leaves out: generation (fspo/rollout), the math of each rule
(fspo/clipping, fspo/losses.py, fspo/advantages.py) and run infrastructure (fspo/runtime).
"""
