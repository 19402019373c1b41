"""LUSPO (Liu et al., arXiv 2602.05261): GSPO with each sequence's loss scaled by its length. verl 0.9.1 has
none; tests/test_clip_cispo_sapo_gmpo_luspo.py pins this reading by hand.
"""
from __future__ import annotations

from typing import Any

from fspo.clipping.gspo import GSPOClip
from fspo.clipping.registry import _ratio_kwargs, rule_loss


class LUSPOClip(GSPOClip):
    """LUSPO's clip, GSPO's unchanged; the length factor is the aggregation (arXiv 2602.05261, TRL's
    ``loss_type="luspo"``, ``(per_sequence_loss * L).mean()``):

        J = (1 / G) sum_i L_i min(s_i A_i, clip(s_i, 1 - low, 1 + high) A_i),   s_i = exp(S_i / L_i)

    With ``seq-mean-token-sum`` (k_i = 1 / G) the aggregated loss is exactly J: every token of an unclipped
    sequence gets -A_i s_i / G whatever L_i. Settings, masks, cap and c(L) are GSPO's.
    """


@rule_loss("luspo", mode="seq-mean-token-sum", default_mode="seq-mean-token-sum", kl_clamp=None)
def policy_loss_luspo(config: Any) -> GSPOClip:
    """LUSPO: `LUSPOClip`, aggregated with seq-mean-token-sum whatever ``loss_agg_mode`` says (the length factor is
    the method); metrics as gspo's."""
    return LUSPOClip(**_ratio_kwargs(config, LUSPOClip))
