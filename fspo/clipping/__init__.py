"""Clipping rules: one file per rule, all implementing `ClipRule` (see base.py)."""
from fspo.clipping.base import ClipResult, ClipRule
from fspo.clipping.fspo import FSPOClip
from fspo.clipping.grpo import GRPOClip
from fspo.clipping.gspo import GSPOClip
from fspo.clipping.rloo import RLOOClip

__all__ = ["ClipResult", "ClipRule", "FSPOClip", "GRPOClip", "GSPOClip", "RLOOClip"]
