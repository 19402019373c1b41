"""Sequence packing: several (prompt + response) sequences per row, no padding between them.

Two layouts. Under segment attention (sdpa models) a micro-batch is ONE row of its sequences back to back (budget
= real tokens, waste 0), attention running per sequence. Otherwise the sequences are packed into rows of a common
width with ``attention_mask=None`` and ``position_ids`` restarting at 0 per sequence: Hugging Face models then
build a block-diagonal causal mask from the position ids, so the log-probs equal the padded computation's. A
row's unused tail is filler with its own positions.

    padding waste = (rows * width - real tokens) / real tokens
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
from torch import Tensor

from fspo.models.segment_attention import segment_runs
from fspo.types import RolloutBatch


@dataclass
class TokenUsage:
    """Token slots the forward passes computed (``slots``) vs real tokens in them (``tokens``)."""

    slots: float = 0.0
    tokens: float = 0.0

    def add(self, slots: int, tokens: int) -> None:
        self.slots += float(slots)
        self.tokens += float(tokens)

    @property
    def waste(self) -> float:
        """Padded tokens / real tokens (0 when nothing was counted)."""
        return (self.slots - self.tokens) / self.tokens if self.tokens else 0.0


def pack_rows(lengths: Sequence[int], width: int) -> List[List[int]]:
    """First-fit decreasing: index lists, one per row, each row's lengths summing to <= ``width`` (at least the
    longest length); longest first into the first row with room, ties in index order."""
    lengths = [int(x) for x in lengths]
    if lengths and max(lengths) > width:
        raise ValueError(f"pack_rows: a sequence of {max(lengths)} tokens does not fit rows of width {width}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    rows: List[List[int]] = []
    room: List[int] = []
    for i in order:
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(width - lengths[i])
    return rows


WIDTH_FACTORS = (1.0, 1.25, 1.5, 1.75, 2.0)


def row_width(total_lengths: Tensor, max_tokens: int, row_factor: float = 2.0, tolerance: float = 0.03) -> int:
    """Packed row width: the narrowest of ``f`` x the longest sequence (f in `WIDTH_FACTORS` up to
    ``row_factor``, within [longest, max(longest, max_tokens)]) whose slot count ``rows * width`` is within
    ``tolerance`` of the fewest. Rows of the longest length pack badly when lengths exceed half of it; wider
    rows cost attention work where the kernel computes the masked attention in full, so ties go narrow."""
    longest = int(total_lengths.max()) if total_lengths.numel() else 1
    cap = max(longest, int(max_tokens))
    factors = [f for f in WIDTH_FACTORS if f < row_factor] + [row_factor]
    widths = sorted({max(longest, min(int(f * longest), cap)) for f in factors})
    if len(widths) == 1 or not total_lengths.numel():
        return widths[0]
    lengths = total_lengths.tolist()
    slots = {w: len(pack_rows(lengths, w)) * w for w in widths}
    fewest = min(slots.values())
    return min(w for w in widths if slots[w] <= fewest * (1 + tolerance))


def packed_micro_batches(total_lengths: Tensor, max_tokens: int, row_factor: float = 2.0,
                         width: Optional[int] = None) -> List[Tensor]:
    """Index tensors of micro-batches whose packed size ``rows * width <= max_tokens`` (``width`` or
    `row_width`); pack each with `pack_batch(..., width)`."""
    if max_tokens < 1:
        raise ValueError(f"ppo.micro_batch_max_tokens must be >= 1, got {max_tokens}")
    if total_lengths.numel() == 0:
        return []
    width = width or row_width(total_lengths, max_tokens, row_factor)
    rows = pack_rows(total_lengths.tolist(), width)
    per = max(1, max_tokens // width)
    return [torch.tensor([i for row in rows[s:s + per] for i in row], dtype=torch.long)
            for s in range(0, len(rows), per)]


@dataclass
class PackedLayout:
    """``input_ids`` / ``position_ids`` [R, W] of a packed micro-batch; ``logit_index`` [B, T]: flat index of the
    logit that predicts response token t of sequence i (0 on response padding)."""

    input_ids: Tensor
    position_ids: Tensor
    logit_index: Tensor
    real_tokens: int
    segments: Optional[list] = None  # `pack_segments`: the runs of fspo.models.segment_attention

    @property
    def slots(self) -> int:
        return self.input_ids.numel()


def pack_batch(batch: RolloutBatch, width: int = 0, pad_token_id: int = 0) -> PackedLayout:
    """Pack ``batch``'s sequences (prompt tokens then response tokens, padding dropped) into rows of
    ``max(width, longest sequence)`` tokens by `pack_rows`."""
    p_len = batch.prompt_mask.sum(-1).tolist()
    r_len = batch.response_mask.sum(-1).tolist()
    totals = [int(p) + int(r) for p, r in zip(p_len, r_len)]
    width = max([int(width)] + totals)
    rows = pack_rows(totals, width)
    device = batch.response_ids.device
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long, device=device)
    pos = torch.zeros((len(rows), width), dtype=torch.long, device=device)
    T = batch.response_ids.shape[1]
    index = torch.zeros(batch.batch_size, T, dtype=torch.long, device=device)
    P = batch.prompt_ids.shape[1]
    ar = torch.arange(width, device=device)
    for r, row in enumerate(rows):
        off = 0
        for i in row:
            p, n = int(p_len[i]), int(r_len[i])
            ids[r, off:off + p] = batch.prompt_ids[i, P - p:]
            ids[r, off + p:off + p + n] = batch.response_ids[i, :n]
            pos[r, off:off + p + n] = ar[:p + n]
            # response token t is predicted by the logit at position p - 1 + t of its sequence
            index[i, :n] = r * width + off + p - 1 + torch.arange(n, device=device)
            off += p + n
        pos[r, off:] = ar[:width - off]  # filler: a separate block (positions restart at 0)
    return PackedLayout(input_ids=ids, position_ids=pos, logit_index=index, real_tokens=sum(totals))


def segment_micro_batches(total_lengths: Tensor, max_tokens: int) -> List[Tensor]:
    """Micro-batches of at most ``max_tokens`` real tokens by first-fit decreasing (a longer sequence alone),
    each packed into ONE row by `pack_segments`."""
    if max_tokens < 1:
        raise ValueError(f"ppo.micro_batch_max_tokens must be >= 1, got {max_tokens}")
    if total_lengths.numel() == 0:
        return []
    lengths = total_lengths.tolist()
    fits = [i for i, n in enumerate(lengths) if n <= max_tokens]
    bins = [[fits[j] for j in row] for row in pack_rows([lengths[i] for i in fits], int(max_tokens))]
    bins += [[i] for i, n in enumerate(lengths) if n > max_tokens]
    return [torch.tensor(b, dtype=torch.long) for b in bins]


def pack_segments(batch: RolloutBatch) -> PackedLayout:
    """All of ``batch``'s sequences in one row [1, N] (N real tokens), longest first, positions restarting at 0
    per sequence, ``segments`` their runs for segment attention."""
    p_len = batch.prompt_mask.sum(-1).tolist()
    r_len = batch.response_mask.sum(-1).tolist()
    totals = [int(p) + int(r) for p, r in zip(p_len, r_len)]
    order = sorted(range(len(totals)), key=lambda i: -totals[i])
    device = batch.response_ids.device
    P, T = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
    ids, pos = [], []
    index = torch.zeros(batch.batch_size, T, dtype=torch.long, device=device)
    off = 0
    for i in order:
        p, n = int(p_len[i]), int(r_len[i])
        ids += [batch.prompt_ids[i, P - p:], batch.response_ids[i, :n]]
        pos.append(torch.arange(p + n, device=device))
        index[i, :n] = off + p - 1 + torch.arange(n, device=device)  # the logit predicting response token t
        off += p + n
    empty = torch.zeros(0, dtype=torch.long, device=device)
    return PackedLayout(input_ids=torch.cat([empty] + ids)[None], position_ids=torch.cat([empty] + pos)[None],
                        logit_index=index, real_tokens=off, segments=segment_runs([totals[i] for i in order]))
