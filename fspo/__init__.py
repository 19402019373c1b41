"""FSPO: length-fair sequence-level policy optimisation (see README.md)."""
