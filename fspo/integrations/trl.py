"""FSPO inside TRL: `FSPOConfig` (a GRPOConfig) and `FSPOTrainer` (a GRPOTrainer whose loss is FSPO's).

The loss: TRL's log-prob pass, then fspo.clipping.registry's ``fspo`` (settings by ``fspo_settings``, shared with
verl.py) or any rule of fspo.clipping given as ``clip_rule`` (a stateful band observes every training
micro-batch). Generation, rewards, advantages, old log-probs and vLLM stay TRL's; with
``vllm_importance_sampling_correction`` TRL's ``importance_sampling_ratio`` multiplies the token loss. Metrics and
refused settings: docs/integrations.md.

Aggregation (per process; TRL averages gradients over processes), loss_type -> ``fspo.losses.aggregate`` mode:
``dapo`` (the default; the paper's token-mean over the optimizer step's tokens) token-mean with TRL's normaliser
num_items_in_batch / processes (x grad-accum / steps_per_generation in training) as total_tokens; ``bnpo``
token-mean over the micro-batch; ``grpo`` seq-mean-token-mean; ``dr_grpo`` seq-mean-token-sum-norm with norm_len
max_completion_length and total_seqs the rows; the last three divided by the grad-accumulation steps, as TRL
does. ``beta`` > 0 adds beta x the same aggregation of TRL's k3 KL.
"""
from __future__ import annotations

from fspo.integrations.requirements import require

require("trl")

from dataclasses import dataclass, field  # noqa: E402
from types import SimpleNamespace  # noqa: E402
from typing import Any, Dict, Optional, Tuple  # noqa: E402

import torch  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from fspo.clipping.base import ClipRule  # noqa: E402
from fspo.clipping.fspo import FSPOClip  # noqa: E402
from fspo.clipping.registry import FSPO_DEFAULTS, _run_full, fspo_settings  # noqa: E402
from fspo.diagnostics.bins import LengthBins  # noqa: E402
from fspo.diagnostics.length_counts import BIN_WIDTH, fractions, length_counts  # noqa: E402
from fspo.losses import aggregate  # noqa: E402

LOSS_TYPES = ("dapo", "bnpo", "grpo", "dr_grpo")
#: GRPOTrainer inputs passed through to its log-prob pass (multimodal models)
_MODEL_INPUTS = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes",
                 "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")


def _paper(default: Any, why: str) -> Any:
    return field(default=default, metadata={"help": f"FSPO paper default: {why}"})


@dataclass
class FSPOConfig(GRPOConfig):
    """GRPOConfig with the paper's settings (Tables 2 and 4) and FSPO's: ``c_upper``, ``c_lower``,
    ``c_dual`` (log-space band per sqrt(token), 0.03 each; ``c_dual=None`` turns the dual clip off),
    ``ratio_grad`` ("per_token" | "length_weighted") and ``length_bin_width`` (metric bins)."""

    learning_rate: float = _paper(1e-6, "AdamW lr 1e-6 (Table 2)")
    weight_decay: float = _paper(0.01, "AdamW weight decay 0.01 (verl's default, the paper's trainer)")
    max_grad_norm: float = _paper(1.0, "gradient clipping at norm 1.0")
    lr_scheduler_type: str = _paper("constant", "constant learning rate")
    num_generations: Optional[int] = _paper(16, "rollout n = 16 (Table 2)")
    per_device_train_batch_size: int = _paper(16, "one group of n = 16 per device step (TRL: 8, < n)")
    temperature: float = _paper(1.0, "training sampling temperature 1.0")
    beta: float = _paper(0.0, "no KL term")
    scale_rewards: str = _paper("group", "GRPO group z-score advantages")
    loss_type: str = _paper("dapo", "token-mean over the optimizer step's tokens")
    c_upper: float = _paper(FSPO_DEFAULTS["c_upper"], "upper band c, log space per sqrt(token)")
    c_lower: float = _paper(FSPO_DEFAULTS["c_lower"], "lower band c, log space per sqrt(token)")
    c_dual: Optional[float] = _paper(FSPO_DEFAULTS["c_dual"], "dual clip c for A < 0 (None: off)")
    ratio_grad: str = _paper(FSPO_DEFAULTS["ratio_grad"], "per-token gradient of the sequence ratio")
    length_bin_width: int = _paper(BIN_WIDTH, f"length bins of {BIN_WIDTH} tokens for the per-length clip fractions")
    clip_rule: Optional[dict] = field(default=None, metadata={"help": "another clip rule of fspo.clipping instead "
                                      "of the fixed FSPO band, as a Hydra node, e.g. {'_target_': "
                                      "'fspo.clipping.fspo.FSPOClip', 'band': 'ema', 'z': 1.0} or "
                                      "{'_target_': 'fspo.clipping.vespo.VESPOClip'}; the c_* settings are then "
                                      "unused"})

    def __post_init__(self):
        super().__post_init__()
        check_args(self)


def check_args(args: GRPOConfig) -> None:
    """ValueError("FSPOConfig: <setting>: <why>; <fix>") for settings FSPOTrainer cannot honour, and the rule's
    own checks of the FSPO settings; a plain GRPOConfig too."""
    refuse = [
        (args.loss_type not in LOSS_TYPES, f"loss_type={args.loss_type!r}: FSPOTrainer aggregates FSPO's loss "
         f"as one of {list(LOSS_TYPES)}; set loss_type to one of them"),
        (args.importance_sampling_level != "token", "importance_sampling_level: FSPO defines its own sequence "
         "ratio; leave importance_sampling_level='token' (TRL's default)"),
        (args.delta is not None, "delta (two-sided GRPO clip): FSPO has its own dual clip c_dual; set delta=None"),
        (args.top_entropy_quantile < 1.0, "top_entropy_quantile < 1 is not supported by FSPOTrainer; set it to 1.0"),
        (args.off_policy_mask_threshold is not None, "off_policy_mask_threshold is not supported by FSPOTrainer; "
         "set it to None"),
        (args.entropy_coef != 0.0 or args.use_adaptive_entropy, "the entropy bonus is not supported by "
         "FSPOTrainer; set entropy_coef=0.0 and use_adaptive_entropy=False"),
        (int(getattr(args, "length_bin_width", BIN_WIDTH)) < 1, "length_bin_width must be >= 1 token, got "
         f"{getattr(args, 'length_bin_width', None)!r}"),
    ]
    for bad, msg in refuse:
        if bad:
            raise ValueError(f"FSPOConfig: {msg}")
    if getattr(args, "clip_rule", None) is None:
        FSPOClip(**fspo_settings(args))
    else:
        build_rule(args)


def build_rule(args) -> Optional[ClipRule]:
    """The `ClipRule` of ``args.clip_rule`` (a Hydra node), or None (the fixed band of ``c_*``)."""
    spec = getattr(args, "clip_rule", None)
    if spec is None:
        return None
    from hydra.utils import instantiate

    try:
        rule = instantiate(dict(spec))
    except Exception as e:  # noqa: BLE001 - a bad node: one line naming it
        cause = e.__cause__ or e
        raise ValueError(f"FSPOConfig: clip_rule={dict(spec)!r} does not build ({type(cause).__name__}: "
                         f"{str(cause).splitlines()[0]}); give _target_ a ClipRule of fspo.clipping and its "
                         f"settings") from None
    if not isinstance(rule, ClipRule):
        raise ValueError(f"FSPOConfig: clip_rule={dict(spec)!r} is a {type(rule).__name__}, "
                         f"not a fspo.clipping ClipRule")
    return rule


def aggregation(loss_type: str, rows: int, max_completion_length: int, num_items_in_batch: Any,
                num_processes: int, accumulation: float, steps_per_generation: int, train: bool
                ) -> Tuple[str, Dict[str, Any], float]:
    """(``aggregate`` mode, its totals as verl's global_batch_info, divisor): TRL's normalisation of
    ``loss_type``."""
    if loss_type == "dapo":
        tokens = num_items_in_batch.clamp(min=1.0) / num_processes
        if train:
            tokens = tokens * accumulation / steps_per_generation
        return "token-mean", {"batch_num_tokens": tokens}, 1.0
    divisor = float(accumulation) if train else 1.0
    if loss_type == "bnpo":
        return "token-mean", {}, divisor
    if loss_type == "grpo":
        return "seq-mean-token-mean", {}, divisor
    return "seq-mean-token-sum-norm", {"global_batch_size": rows, "loss_scale_factor": max_completion_length}, divisor


class FSPOTrainer(GRPOTrainer):
    """GRPOTrainer whose loss is FSPO's; ``args`` an `FSPOConfig` (a plain GRPOConfig gets the paper's settings)."""

    def __init__(self, *a, **kw):
        args = kw.get("args", a[2] if len(a) > 2 else None)
        if args is not None:  # before the model loads; TRL's default GRPOConfig() passes
            check_args(args)
        super().__init__(*a, **kw)
        width = int(getattr(self.args, "length_bin_width", BIN_WIDTH))
        self._fspo_bins = LengthBins(width=width, max_len=max(int(self.max_completion_length or width), width))
        self._fspo_counts: Dict[str, Optional[torch.Tensor]] = {"train": None, "eval": None}
        self._fspo_rule = build_rule(self.args)  # a rule's state (an EMA band's) lives here
        if self._fspo_rule is not None:
            self._fspo_rule.to(self.accelerator.device)

    def _compute_loss(self, model, inputs):
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, inputs["completion_ids"].size(1), compute_entropy=True,
            compute_aux_loss=self.aux_loss_enabled, **{k: inputs.get(k) for k in _MODEL_INPUTS})
        old = inputs.get("old_per_token_logps")
        old = logps.detach() if old is None else old
        mode = "train" if self.model.training else "eval"
        agg_mode, info, divisor = aggregation(
            self.loss_type, mask.size(0), self.max_completion_length, inputs.get("num_items_in_batch"),
            self.accelerator.num_processes, self.current_gradient_accumulation_steps,
            self.args.steps_per_generation, mode == "train")
        weights = inputs["importance_sampling_ratio"] if self.use_vllm and self.vllm_importance_sampling_correction \
            else None
        config = SimpleNamespace(**fspo_settings(self.args), global_batch_info=info)
        rule = FSPOClip(**fspo_settings(self.args)) if self._fspo_rule is None else self._fspo_rule
        loss, _, res = _run_full(rule, old, logps, inputs["advantages"], mask, agg_mode, config,
                                 rollout_is_weights=weights)
        if self._fspo_rule is not None and mode == "train":  # a calibrated / EMA band observes every micro-batch
            m = mask.bool()
            self._fspo_rule.observe(res.seq_log_ratio, m.sum(-1), (logps.detach() - old).float() * m, m)
        if self.beta != 0.0:
            ref = inputs["ref_per_token_logps"]
            kl = torch.exp(ref - logps) - (ref - logps) - 1
            if self.args.use_bias_correction_kl:
                kl = kl * torch.exp(logps - old)
            totals = {"total_tokens": info.get("batch_num_tokens"), "total_seqs": info.get("global_batch_size"),
                      "norm_len": info.get("loss_scale_factor")}
            loss = loss + self.beta * aggregate(kl, mask, agg_mode, **totals).loss
            self._metrics[mode]["kl"].append(self._global_mean(kl, mask))
        loss = loss / divisor
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * aux_loss / divisor
        self._log_fspo(mode, res, mask, entropies)
        return loss

    def _global_mean(self, x: torch.Tensor, mask: torch.Tensor) -> float:
        """Masked mean of ``x`` over every process's tokens (TRL's global_masked_mean)."""
        m = mask.float()
        totals = self.accelerator.reduce(torch.stack([(x.detach().float() * m).sum(), m.sum()]), reduction="sum")
        return (totals[0] / totals[1].clamp(min=1.0)).item()

    def _log_fspo(self, mode: str, res, mask: torch.Tensor, entropies: torch.Tensor) -> None:
        """TRL's entropy and clip_ratio/* metrics from FSPO's binding masks; per-length counts summed."""
        metrics = self._metrics[mode]
        metrics["entropy"].append(self._global_mean(entropies, mask))
        for key, hit in (("high_mean", res.clip_upper), ("low_mean", res.clip_lower),
                         ("region_mean", res.clip_upper | res.clip_lower), ("dual_mean", res.clip_dual)):
            metrics[f"clip_ratio/{key}"].append(self._global_mean(hit.float(), mask))
        counts = self.accelerator.reduce(length_counts(res, mask, self._fspo_bins), reduction="sum")
        prev = self._fspo_counts[mode]
        self._fspo_counts[mode] = counts if prev is None else prev + counts

    def log(self, logs: Dict[str, float], start_time: Optional[float] = None) -> None:
        """TRL's log, with the per-length fractions of the counts since the last log added first."""
        mode = "train" if self.model.training else "eval"
        counts = self._fspo_counts[mode]
        if counts is not None:
            frac = fractions(counts, self._fspo_bins)
            n_seq = dict(zip(self._fspo_bins.labels, counts[0].tolist()))
            for label, value in frac["clip"].items():
                self._metrics[mode][f"clip_ratio/by_length/{label}"] = [value]
                self._metrics[mode][f"clip_ratio/out_of_band/by_length/{label}"] = [frac["out"][label]]
                self._metrics[mode][f"clip_ratio/n_seq/by_length/{label}"] = [n_seq[label]]
            self._fspo_counts[mode] = None
        super().log(logs, start_time)
