"""FSPO inside other trainers (verl.py, trl.py): thin adapters over the registry's ``fspo`` loss, each importing
its library, so nothing here is imported by ``import fspo``. Recipes: docs/integrations.md."""
