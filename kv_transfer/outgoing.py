"""What a sender has in flight: the segments of a send call, and one transfer's state."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from kv_transfer.blocks import full_heads, gather
from kv_transfer.handoff import KVDestination


@dataclass(slots=True)
class SegmentOut:
    """One segment to send: positions ``[start, start + count)`` of the request's block
    list (source blocks ``ids``), one layer, the source heads ``heads`` (local)."""

    layer: int
    start: int
    count: int
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    ids: list[int]
    heads: tuple[int, int]
    contiguous: bool  # consecutive source ids
    shape: tuple[int, ...]  # of K (and of V): [count, block_size, heads, head_dim]
    nbytes: int  # of K (and of V)
    zero_copy: bool  # K and V are each one contiguous region of the cache (``views``)
    kv_cache: torch.Tensor | None = None  # the rank's whole cache, when sent from one

    def views(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as views of the cache (``zero_copy`` segments only)."""
        b0 = self.ids[0]
        return self.k_cache[b0 : b0 + self.count], self.v_cache[b0 : b0 + self.count]

    def gather_into(self, k_out: torch.Tensor, v_out: torch.Tensor) -> None:
        """Copy K and V into ``k_out``/``v_out`` (``shape``, contiguous)."""
        gather(self.k_cache, self.ids, self.heads, k_out)
        gather(self.v_cache, self.ids, self.heads, v_out)

    def pieces(self, cache: torch.Tensor) -> list[torch.Tensor] | None:
        """K (or V) as contiguous views whose bytes, one after the other, are the
        segment's: one per run of consecutive ids. None when heads are partial."""
        if not full_heads(cache, self.heads):
            return None
        out, i, ids = [], 0, self.ids
        while i < len(ids):
            j = i + 1
            while j < len(ids) and ids[j] == ids[j - 1] + 1:
                j += 1
            out.append(cache[ids[i] : ids[i] + j - i])
            i = j
        return out


@dataclass(eq=False)
class Outgoing:
    """Sender-side state of one transfer (backends add their own fields)."""

    transfer_id: str
    key: int
    dst: KVDestination
    started: float = field(default_factory=time.monotonic)
    bytes: int = 0
    segments: dict[str, int] = field(default_factory=dict)  # per destination address
    layers: set[int] = field(default_factory=set)
    buffers: list[torch.Tensor] = field(default_factory=list)  # pooled, returned at the end
    extra: dict = field(default_factory=dict)
