"""Where and how a run's processes run: the bottom layer of fspo.runtime (imports no other runtime subpackage)."""
