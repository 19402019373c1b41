"""Clipping rules: one file per rule, all implementing `ClipRule` (see base.py).

The names below load on first use, so that fspo.clipping.settings (the rules' settings, checked before
anything loads) imports without torch.
"""
from importlib import import_module

_WHERE = {"ClipResult": "base", "ClipRule": "base", "FSPOClip": "fspo", "GRPOClip": "grpo", "GSPOClip": "gspo",
          "RLOOClip": "rloo"}
__all__ = list(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(import_module(f"fspo.clipping.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'fspo.clipping' has no attribute {name!r}")
