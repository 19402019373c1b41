"""The up-front checks of a launch and how user errors are shown: the top layer of fspo.runtime.

Owns: config_check.py (a composed config's settings, before anything runs; its key-by-key table in
config_rules.py), run_config.py (the config a
launch runs with, the stored one on resume), store_check.py (storage and tracking-store checks),
sqlite_store.py (atomic creation of a SQLite MLflow store), run_lock.py (one run per output folder),
errors.py (user errors as one line) and console.py (what the console shows). May import
fspo.runtime.launch and fspo.runtime.checkpoints. Leaves out: writing checkpoints and the memory plan.
"""
