"""Per-length gradients: ||g_L|| for the paper's weighted LRE and the Theorem 1 cosine, measured.

For sequence i in length bin b (n_b sequences, N in all), with s_i = exp(clamp(S_i, -20, 20)) detached,
S_i = sum_t (logp_t - logp_old_t), and the rule's per-token loss l_it:

    u_i = grad of -A_i s_i sum_t logp_t     the sequence-IS policy gradient (the paper's target, unclipped)
    c_i = grad of sum_t l_it                 what the rule's loss gives that sequence (0 where it is clipped)
    g*_b = (1 / n_b) sum_{i in b} u_i,       q_b g^b_b = (1 / n_b) sum_{i in b} c_i
    g* = sum_b (n_b / N) g*_b,               g^b = sum_b (n_b / N) q_b g^b_b      (the batch gradients)

The ``probe/`` metrics built from them: docs/metrics.md. Bins with fewer than two sequences are skipped; a cosine
with a zero gradient is not reported. Two backward passes per populated bin.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence

import torch
from torch import Tensor

from fspo.clipping._common import MAX_LOG_RATIO, prepare, seq_advantage
from fspo.diagnostics.bins import LengthBins
from fspo.diagnostics.lre import acceptance, lre


def _grads(y: Tensor, params: Sequence[Tensor]) -> List[Tensor]:
    gs = torch.autograd.grad(y, params, retain_graph=True, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g.detach() for p, g in zip(params, gs)]


def _dot(a: List[Tensor], b: List[Tensor]) -> float:
    return float(sum((x.double() * y.double()).sum() for x, y in zip(a, b)))


def _cos(a: List[Tensor], b: List[Tensor]) -> float:
    na, nb = _dot(a, a) ** 0.5, _dot(b, b) ** 0.5
    return _dot(a, b) / (na * nb) if na > 0 and nb > 0 else float("nan")


def partition_lre(labels: Tensor, accepted: Tensor) -> float:
    """The paper's LRE over a partition: cells = distinct ``labels`` [B] (e.g. the group's mean reward),
    q_c = mean of ``accepted`` [B] (0/1 or a fraction) in cell c, weights n_c: 0.5 sum_c n_c |q_c / q_bar - 1| / N."""
    labels = torch.as_tensor(labels)
    cells = torch.unique(labels)
    n = torch.stack([(labels == c).sum() for c in cells]).double()
    rej = torch.stack([(1.0 - accepted.double())[labels == c].sum() for c in cells])
    return float(lre(acceptance(n, rej), n))


def gradient_probe(logp: Tensor, old_log_prob: Tensor, advantages: Tensor, response_mask: Tensor, clip,
                   params: Sequence[Tensor], bins: LengthBins, partition: Optional[Tensor] = None) -> Dict[str, float]:
    """The ``probe/*`` numbers for one batch; ``logp`` [B, T] carries the graph to ``params``; ``partition`` [B]
    adds ``probe/partition_lre``."""
    params = [p for p in params if p.requires_grad]
    res = clip(logp, old_log_prob, advantages, response_mask)
    p = prepare("gradient_probe", logp, old_log_prob, advantages, response_mask)
    d = torch.where(p.mask, p.log_prob.detach() - p.old_log_prob, 0.0)
    s = torch.exp(d.sum(-1).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    lp = torch.where(p.mask, p.log_prob, 0.0)
    u_seq = -(seq_advantage(advantages, p) * s) * lp.sum(-1)
    c_seq = res.token_loss.sum(-1)
    ok = (res.in_band.float().sum(-1) / p.lengths.clamp(min=1.0)).double()  # accepted share per sequence
    idx = bins.index(p.lengths.long())
    out: Dict[str, float] = {}
    n_list, q_list, g_list = [], [], []
    g_all = c_all = None
    for b, label in enumerate(bins.labels):
        rows = idx == b
        n_b = int(rows.sum())
        if n_b < 2:
            continue
        gu = _grads(u_seq[rows].sum() / n_b, params)
        gc = _grads(c_seq[rows].sum() / n_b, params)
        q_b = float(ok[rows].mean())
        norm = _dot(gu, gu) ** 0.5
        out[f"probe/gnorm/{label}"], out[f"probe/q/{label}"] = norm, q_b
        if math.isfinite(c_b := _cos(gc, gu)):  # undefined where a gradient is 0 (e.g. every A = 0): not logged
            out[f"probe/cos/{label}"] = c_b
        n_list.append(n_b), q_list.append(q_b), g_list.append(norm)
        g_all = [x * n_b for x in gu] if g_all is None else [a + x * n_b for a, x in zip(g_all, gu)]
        c_all = [x * n_b for x in gc] if c_all is None else [a + x * n_b for a, x in zip(c_all, gc)]
    if not n_list:
        return out
    n, q, g = (torch.tensor(v, dtype=torch.float64) for v in (n_list, q_list, g_list))
    total = float(n.sum())
    g_all, c_all = [x / total for x in g_all], [x / total for x in c_all]
    g_norm = _dot(g_all, g_all) ** 0.5
    if math.isfinite(c := _cos(c_all, g_all)):
        out["probe/cos"] = c
    if g_norm > 0:
        out["probe/kappa"] = float((n * g).sum() / total) / g_norm
    out["probe/lre"] = float(lre(q, n))
    out["probe/lre_w"] = float(lre(q, n * g, q_bar_weights=n))
    if partition is not None:
        keep = idx >= 0
        out["probe/partition_lre"] = partition_lre(torch.as_tensor(partition)[keep.cpu()], ok[keep])
    return out


def group_reward(rewards: Tensor, group_ids: Optional[Tensor]) -> Tensor:
    """Each sequence's group mean reward (the prompt's difficulty as the rollout measured it), rounded to 1e-6
    so equal means form one cell; the sequence's own reward when there are no group ids."""
    r = rewards.double()
    if group_ids is None:
        return torch.round(r * 1e6) / 1e6
    out = torch.empty_like(r)
    for gid in torch.unique(group_ids):
        rows = group_ids == gid
        out[rows] = r[rows].mean()
    return torch.round(out * 1e6) / 1e6


def probe_minibatch(module, mb) -> Dict[str, float]:
    """`gradient_probe` on training mini-batch ``mb`` (the group reward as the partition), one extra forward
    pass; {} on more than one process (it needs the whole mini-batch's graph)."""
    from fspo.runtime.launch.distributed import dp_rank_size
    from fspo.update import forward as passes

    if dp_rank_size(module)[1] != 1 or mb.old_log_probs is None:
        return {}
    logp, _ = passes.log_probs(module, mb)
    labels = group_reward(mb.rewards, mb.group_ids) if mb.rewards is not None else None
    return gradient_probe(logp, mb.old_log_probs, mb.advantages, mb.response_mask, module.clip,
                          list(module.policy.parameters()), module.diagnostics.bins, partition=labels)
