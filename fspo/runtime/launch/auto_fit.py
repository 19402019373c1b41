"""Auto-fit: where the memory plan does not fit, the run picks the settings that make it fit, and says so.

`STEPS`, in order, until the peak is at most `MARGIN` x the usable memory (each skipped when the command line
names its key): a LoRA run's frozen base in bf16, the LM head in chunks, ``ppo.micro_batch_max_tokens``
halved (down to the longest sequence or `MIN_TOKENS`), activation checkpointing. Where even all of them do
not fit, nothing is changed and the plan's refusal names the layouts that would. ``memory_plan.auto_fit=false``
turns this off.
"""
from __future__ import annotations

import copy
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from omegaconf import OmegaConf, open_dict

from fspo.runtime.launch.memory_components import GIB
from fspo.runtime.launch.memory_plan import FSDP, _plan, _select
from fspo.runtime.launch.placement import _named, named_keys

MARGIN = 0.95      # the fitted peak is at most this share of the usable memory (headroom x device)
CHUNK_ROWS = 1024
MIN_TOKENS = 1024


def _lora_bf16_base(cfg) -> Iterator[List[Tuple[str, object]]]:
    if int(_select(cfg, "model.lora.rank", 0) or 0) > 0 and str(_select(cfg, "model.dtype", "float32")) == "float32":
        yield [("model.dtype", "bfloat16"), ("ppo.autocast", None)]


def _chunked_head(cfg) -> Iterator[List[Tuple[str, object]]]:
    if int(_select(cfg, "ppo.lm_head_chunk_rows", 0)) == 0:
        yield [("ppo.lm_head_chunk_rows", CHUNK_ROWS)]


def _smaller_micro_batch(cfg) -> Iterator[List[Tuple[str, object]]]:
    longest = int(_select(cfg, "data.max_prompt_len", 0)) + int(_select(cfg, "rollout.sampling.max_new_tokens", 0))
    budget = int(_select(cfg, "ppo.micro_batch_max_tokens", 0))
    while budget > max(longest, MIN_TOKENS) and budget // 2 >= MIN_TOKENS:
        budget //= 2
        yield [("ppo.micro_batch_max_tokens", budget)]


def _activation_checkpointing(cfg) -> Iterator[List[Tuple[str, object]]]:
    key = "trainer.strategy.activation_checkpointing" if str(_select(cfg, "trainer.strategy._target_", "")) == FSDP \
        else "model.activation_checkpointing"
    if not _select(cfg, key, False):
        yield [(key, True)]


STEPS: Tuple[Tuple[str, Callable], ...] = (
    ("the frozen LoRA base in bf16", _lora_bf16_base),
    ("the LM head in chunks", _chunked_head),
    ("a smaller micro-batch token budget", _smaller_micro_batch),
    ("activation checkpointing", _activation_checkpointing),
)


def _peak_and_usable(cfg, available: Optional[int]) -> Optional[Tuple[int, float]]:
    found = _plan(cfg, available)
    if found is None:
        return None
    _, _, plan, avail, _, headroom = found
    return plan.peak, headroom * avail


def auto_fit(cfg, overrides: Optional[Sequence[str]] = None, available: Optional[int] = None,
             out: Callable[[str], None] = print) -> List[str]:
    """Make ``cfg``'s plan fit; returns the settings chosen as ``key=value`` (empty when it fits as configured,
    auto-fit is off, or nothing makes it fit). ``available``: bytes per rank (default: the device's)."""
    if not _select(cfg, "memory_plan.check", True) or not _select(cfg, "memory_plan.auto_fit", True):
        return []
    first = _peak_and_usable(cfg, available)
    if first is None or first[0] <= MARGIN * first[1]:
        return []
    best = _fit(cfg, named_keys(overrides or ()), available)
    return [] if best is None else _apply(cfg, best, out)  # None: the plan's refusal says what would fit


def fit_preview(cfg, extra: Dict[str, object], available: Optional[int] = None) -> Optional[Tuple[List[str], int]]:
    """(settings, peak) auto-fit would reach from ``cfg`` plus ``extra`` (``cfg`` unchanged), or None."""
    trial = copy.deepcopy(cfg)
    with open_dict(trial):
        for k, v in extra.items():
            OmegaConf.update(trial, k, v, merge=False, force_add=True)
    peak_usable = _peak_and_usable(trial, available)
    if peak_usable is None:
        return None
    if peak_usable[0] <= MARGIN * peak_usable[1]:
        return [], peak_usable[0]
    best = _fit(trial, set(), available)
    return None if best is None else ([f"{k}={_hydra(v)}" for k, v in best[0].items()], best[1])


def _fit(cfg, names: set, available: Optional[int]):
    """(settings, peak, usable) of the first state along `STEPS` within `MARGIN`, else the last that fits."""
    trial, chosen, best = copy.deepcopy(cfg), {}, None
    for _, candidates in STEPS:
        for change in candidates(trial):
            if _named(names, change[0][0]):
                continue  # the setting itself is the user's
            change = [(k, v) for k, v in change if not _named(names, k) and _select(trial, k) != v]
            with open_dict(trial):
                for k, v in change:
                    OmegaConf.update(trial, k, v, merge=False, force_add=True)
                    chosen[k] = v
            peak, usable = _peak_and_usable(trial, available)
            if peak <= usable:
                best = (dict(chosen), peak, usable)
            if peak <= MARGIN * usable:
                return best
    return best


def _apply(cfg, best, out) -> List[str]:
    chosen, peak, usable = best
    with open_dict(cfg):
        for k, v in chosen.items():
            OmegaConf.update(cfg, k, v, merge=False, force_add=True)
    choices = [f"{k}={_hydra(v)}" for k, v in chosen.items()]
    margin = ("" if peak <= MARGIN * usable
              else f" (less than the {1 - MARGIN:.0%} margin: nothing else is left to change)")
    out(f"auto-fit: {' '.join(choices)}: peak {peak / GIB:.2f} GiB = {peak / usable:.2f} of {usable / GIB:.2f} GiB "
        f"usable per rank{margin} (an explicit setting of any of these keys wins; memory_plan.auto_fit=false: off)")
    return choices


def _hydra(v) -> str:
    """``v`` as on the command line: null, true/false, the number."""
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)
