"""FSPO inside other trainers: thin adapters over fspo.clipping.registry's ``fspo`` loss.

verl.py (a verl policy-loss plugin) and trl.py (FSPOConfig / FSPOTrainer for TRL) each import their
library, so nothing here is imported by ``import fspo``; requirements.py checks the library's version
first. Recipes: docs/integrations.md.
"""
