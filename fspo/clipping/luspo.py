"""LUSPO (Liu et al., arXiv 2602.05261): GSPO with each sequence's loss scaled by its length.

Owns: `LUSPOClip` and the registry name ``luspo``. verl 0.9.1 has no LUSPO (no ``luspo`` anywhere in
it), so this file implements the paper's objective as its authors and TRL state it (below) and
tests/test_clip_cispo_sapo_gmpo_luspo.py pins it by hand. Leaves out: aggregation (fspo/losses.py), which is where
LUSPO's length factor lives: conf/method/luspo.yaml selects seq-mean-token-sum.
"""
from __future__ import annotations

from typing import Any

from fspo.clipping.gspo import GSPOClip
from fspo.clipping.registry import _ratio_kwargs, _run, register_policy_loss


class LUSPOClip(GSPOClip):
    """LUSPO's sequence clip: GSPO's, per token in verl's form; LUSPO's length factor is the aggregation.

    The equation implemented (our reading of arXiv 2602.05261: "scale each sequence's loss by its own
    length"; the reading TRL's ``loss_type="luspo"`` with ``importance_sampling_level="sequence"``
    implements, PR huggingface/trl#4988: ``(per_sequence_loss * L).mean()``):

        J = (1 / G) sum_i L_i min(s_i A_i, clip(s_i, 1 - low, 1 + high) A_i),   s_i = exp(S_i / L_i),

    i.e. GSPO's eq. gspo with sequence i weighted by L_i. The rule is GSPOClip unchanged (s_i made per
    token as sg(S_i / L_i) + logp_t - sg(logp_t), so every token holds the sequence's surrogate, as the
    ClipRule contract asks); with ``loss_agg_mode: seq-mean-token-sum`` (k_i = 1 / G) the aggregated
    loss is sum_i L_i loss_i / G, exactly J above, and every token of an unclipped sequence gets the
    gradient -A_i s_i / G, whatever L_i. (GSPO's seq-mean-token-mean gives -A_i s_i / (G L_i): the
    1 / L_i that LUSPO removes.) The loss with any other mode is not LUSPO's.
    Settings, masks, ``in_band`` (1 - low <= s_i <= 1 + high), float-safety cap and the closed-form
    c(L) (eq. c_gspo: the acceptance event is GSPO's) are GSPO's; defaults GSPO's 3e-4 / 4e-4 (LUSPO
    keeps GSPO's clipping).
    """


@register_policy_loss("luspo")
def policy_loss_luspo(old_log_prob, log_prob, advantages, response_mask,
                      loss_agg_mode: str = "seq-mean-token-sum", config: Any = None):
    """LUSPO: `LUSPOClip` (clip 3e-4 / 4e-4) aggregated with seq-mean-token-sum whatever
    ``loss_agg_mode`` says (the length factor is the method, as verl fixes sapo's mode); metrics as
    gspo's (``actor/ppo_kl`` unclamped, ``actor/pg_clipfrac_lower`` 0)."""
    rule = LUSPOClip(**_ratio_kwargs(config, {"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4}))
    return _run(rule, old_log_prob, log_prob, advantages, response_mask, "seq-mean-token-sum", config,
                kl_clamp=None)
