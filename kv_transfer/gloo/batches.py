"""How a gloo/nccl sender turns one destination's segments into messages, and fills a
pack.

gloo pays per message (a rendezvous with the receiver, wake-ups of both sides' threads),
a pack pays per byte (a gather here, a copy out of staging there: on a 2-core machine
whose "network" is itself a memory copy, that costs more than 60 messages of 276 KiB).
So a segment whose K and V are each one region of the cache, of at least
``direct_from`` bytes, goes straight from the cache as two messages; the others are
gathered into a pack, one message of at most ``pack_limit`` bytes. Each batch is one
header: up to ``MAX_SEGS`` segments and at most one pack, so a batch goes out as soon as
its pack is full and the next pack is gathered while the transport moves this one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kv_transfer.blocks import gather, typed
from kv_transfer.gloo.wire import MAX_SEGS, NOT_PACKED, layer_spans
from kv_transfer.outgoing import SegmentOut


@dataclass
class Batch:
    """One header's segments, each with its offset in the pack (or ``NOT_PACKED``)."""

    rows: list[tuple[SegmentOut, int]] = field(default_factory=list)
    pack_bytes: int = 0


def plan_batches(
    segments: list[SegmentOut], pack_limit: int, direct_from: int, most_bytes: int | None = None
) -> list[Batch]:
    """Batches of up to ``MAX_SEGS`` segments, one pack, and ``most_bytes`` of data."""
    out: list[Batch] = []
    batch, data = Batch(), 0
    for seg in segments:
        size = 2 * seg.nbytes
        direct = (seg.zero_copy and seg.nbytes >= direct_from) or size > pack_limit
        full = len(batch.rows) == MAX_SEGS
        full = full or bool(most_bytes and batch.rows and data + size > most_bytes)
        if full or (not direct and batch.pack_bytes and batch.pack_bytes + size > pack_limit):
            out.append(batch)
            batch, data = Batch(), 0
        data += size
        if direct:
            batch.rows.append((seg, NOT_PACKED))
        else:
            batch.rows.append((seg, batch.pack_bytes))
            batch.pack_bytes += size
    if batch.rows:
        out.append(batch)
    return out


def fill_pack(pack: torch.Tensor, rows: list[tuple[SegmentOut, int]]) -> None:
    """Gather the packed segments into ``pack``: consecutive layers at one block
    position with one (indexed) copy when they come from one cache."""
    keys = [(seg.layer, seg.start, seg.count, seg.heads[0], off, seg.nbytes)
            for seg, off in rows]  # fmt: skip
    for i, j in layer_spans(keys):
        seg, offset = rows[i]
        if j - i > 1 and seg.kv_cache is not None:
            out = typed(pack[offset:], seg.k_cache.dtype, (j - i, 2, *seg.shape))
            gather(seg.kv_cache[seg.layer : seg.layer + j - i], seg.ids, seg.heads, out)
            continue
        for seg, offset in rows[i:j]:
            k = typed(pack[offset:], seg.k_cache.dtype, seg.shape)
            v = typed(pack[offset + seg.nbytes :], seg.k_cache.dtype, seg.shape)
            seg.gather_into(k, v)
