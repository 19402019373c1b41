"""Clipping rules, one file per rule, all implementing `ClipRule` (base.py). The names load on first use, so the
settings (fspo.clipping.settings, checked before anything loads) import without torch.
"""
from importlib import import_module

_WHERE = {"ClipResult": "base", "ClipRule": "base", "FSPOClip": "fspo", "GRPOClip": "grpo", "GSPOClip": "gspo",
          "RLOOClip": "rloo"}
__all__ = list(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(import_module(f"fspo.clipping.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'fspo.clipping' has no attribute {name!r}")
