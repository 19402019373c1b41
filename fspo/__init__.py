"""FSPO: length-fair sequence-level policy optimisation (see README.md)."""
from fspo import config  # noqa: F401  (the config schemas, stored for every composition of conf/)
