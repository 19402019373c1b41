"""LoRA adapters on the policy (``model.lora``, built with peft): only the adapters train.

The adapted layer computes y = W0 x + (alpha / r) B A x, A [r, in], B [out, r], B = 0 at start (peft's init), so
the wrapped policy equals the base model before the first update, the gradient restricted to (A, B). The
adapters are float32 (so is AdamW's state); the frozen base may be bf16, as it is never updated.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

ADAPTER = "default"  # peft's adapter name
_PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class LoRASettings:
    """``model.lora``: ``rank`` r (0: off), ``alpha`` (scale alpha / r), ``dropout`` on the adapter input,
    ``target_modules``: linear-layer names (e.g. ``q_proj``; None: every linear layer but the LM head)."""

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: Optional[Tuple[str, ...]] = None
    lr: Optional[float] = None  # AdamW's learning rate for the adapters; None: ppo.lr

    @property
    def enabled(self) -> bool:
        return self.rank > 0


def lora_settings(model_cfg) -> LoRASettings:
    """`LoRASettings` from a model config (a dict or DictConfig with an optional ``lora`` key)."""
    node = (model_cfg or {}).get("lora") if hasattr(model_cfg, "get") else None
    if not node:
        return LoRASettings()
    tm = node.get("target_modules")
    lr = node.get("lr")
    return LoRASettings(rank=int(node.get("rank", 0) or 0), alpha=float(node.get("alpha", 16.0)),
                        dropout=float(node.get("dropout", 0.0) or 0.0),
                        target_modules=None if tm is None else tuple(str(t) for t in tm),
                        lr=None if lr is None else float(lr))


def lora_update_settings(ppo, model_cfg):
    """``ppo`` (a dataclass with ``lr``) with ``lr`` = ``model.lora.lr`` when LoRA is on and that is set."""
    settings = lora_settings(model_cfg)
    return replace(ppo, lr=settings.lr) if settings.enabled and settings.lr is not None else ppo


def target_names(model: nn.Module) -> List[str]:
    """The sorted last-segment names of ``model``'s linear layers but the LM head: what ``target_modules`` may
    name."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                   if isinstance(m, nn.Linear) and m is not head and n})


def check_targets(settings: LoRASettings, available: Sequence[str]) -> List[str]:
    """The target names to adapt (``settings.target_modules``, or all of ``available``); ValueError naming the
    unknown ones."""
    if settings.target_modules is None:
        return list(available)
    if not settings.target_modules:
        raise ValueError("model.lora.target_modules=[]: no layer to adapt; set it to some of "
                         f"{list(available)} or null (all of them)")
    missing = [t for t in settings.target_modules if t not in available]
    if missing:
        raise ValueError(f"model.lora.target_modules={list(settings.target_modules)}: {missing} are not linear "
                         f"layers of this model; it has {list(available)} (null: all of them)")
    return list(settings.target_modules)


def _meta_model(model_cfg) -> Optional[nn.Module]:
    """The configured model built from its config alone on the meta device; None when the config is not
    available before loading."""
    from transformers import AutoModelForCausalLM

    from fspo.models.loading import local_model_config

    try:
        config = local_model_config(model_cfg)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except (OSError, ValueError):
        return None


def check_rank(settings: LoRASettings, model: nn.Module, targets: Sequence[str]) -> None:
    """ValueError when ``settings.rank`` exceeds the smaller side of an adapted layer (r <= min(in, out))."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    sides = {n: min(m.in_features, m.out_features) for n, m in model.named_modules()
             if isinstance(m, nn.Linear) and m is not head and n.rsplit(".", 1)[-1] in targets}
    if sides and settings.rank > min(sides.values()):
        name = min(sides, key=sides.get)
        raise ValueError(f"model.lora.rank={settings.rank}: above the smaller side of the adapted layer {name} "
                         f"({sides[name]}), where a rank-r update B A cannot have rank above {sides[name]}; set "
                         f"model.lora.rank to at most {sides[name]} (8 to 64 is usual)")


def check_lora_targets(model_cfg) -> None:
    """`check_targets` and `check_rank` before anything loads; a no-op without LoRA or when the model's config
    is not available yet (`apply_lora` then checks after loading)."""
    settings = lora_settings(model_cfg)
    if settings.enabled:
        model = _meta_model(model_cfg)
        if model is not None:
            check_rank(settings, model, check_targets(settings, target_names(model)))


def apply_lora(model: nn.Module, settings: LoRASettings) -> nn.Module:
    """``model`` wrapped with peft LoRA adapters (float32, trainable; the base frozen in its dtype), or
    ``model`` unchanged when ``settings.rank == 0``."""
    if not settings.enabled:
        return model
    from peft import LoraConfig, get_peft_model

    targets = check_targets(settings, target_names(model))
    check_rank(settings, model, targets)
    config = LoraConfig(r=int(settings.rank), lora_alpha=float(settings.alpha), lora_dropout=float(settings.dropout),
                        target_modules=targets, bias="none", task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config)
    for name, p in peft_model.named_parameters():
        if "lora_" in name:
            p.data = p.data.float()
            p.requires_grad_(True)
        else:
            p.requires_grad_(False)
    return peft_model


def is_lora(model: nn.Module) -> bool:
    """True when ``model`` carries LoRA adapters (a peft model, possibly sharded)."""
    return any("lora_A" in n for n, _ in model.named_parameters())


def param_counts(model: nn.Module) -> Dict[str, int]:
    """``{"model/trainable_params", "model/total_params"}``: element counts (full, not per shard)."""
    params = list(model.parameters())  # tied weights once; a DTensor's numel is the full tensor's
    return {"model/trainable_params": sum(p.numel() for p in params if p.requires_grad),
            "model/total_params": sum(p.numel() for p in params)}


def adapter_state(state: Dict[str, Tensor], policy: nn.Module, prefix: str = "policy.") -> Dict[str, Tensor]:
    """``state`` with, of the LoRA ``policy``'s entries (prefixed ``prefix``), the trainable ones only; the base
    is rebuilt from the run's ``model`` config on resume and evaluation."""
    trainable = {prefix + n for n, p in policy.named_parameters() if p.requires_grad}
    return {k: v for k, v in state.items() if not k.startswith(prefix) or k in trainable}


def hf_name(peft_name: str) -> str:
    """``base_model.model.x.q_proj.base_layer.weight`` -> ``x.q_proj.weight`` (the HF checkpoint's name)."""
    name = peft_name[len(_PEFT_PREFIX):] if peft_name.startswith(_PEFT_PREFIX) else peft_name
    return name.replace(".base_layer.", ".")


@torch.no_grad()
def merged_weights(model: nn.Module, dtype: Optional[torch.dtype] = None) -> Iterator[Tuple[str, Tensor]]:
    """``(hf_name, tensor)`` of the LoRA ``model`` with W = W0 + (alpha / r) B A for every adapted layer,
    adapters left out (``lm_head.weight`` added when tied), in ``dtype`` where no wider; the merge runs in
    float32 and is rounded once. Under FSDP every rank must drain it (gathers are collectives)."""
    from fspo.models.gather import gathered, gathered_merge

    state = model.state_dict()
    seen_head, embed = False, None
    for raw, t in state.items():
        if "lora_" in raw or raw.endswith("rotary_emb.inv_freq"):
            continue
        name = hf_name(raw)
        seen_head |= name == "lm_head.weight"
        if name.endswith("embed_tokens.weight"):
            embed = raw
        if raw.endswith(".base_layer.weight"):
            layer = model.get_submodule(raw[: -len(".base_layer.weight")])
            yield name, gathered_merge(t, layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight,
                                       float(layer.scaling[ADAPTER]), dtype)
        else:
            yield name, gathered(t, dtype)
    config = getattr(model, "config", None)
    if bool(getattr(config, "tie_word_embeddings", False)) and not seen_head and embed is not None:
        yield "lm_head.weight", gathered(state[embed], dtype)
