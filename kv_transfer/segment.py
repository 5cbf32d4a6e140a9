"""The unit a transfer moves, and the copies out of and into paged caches.

A request's KV is a list of blocks in each pool; the i-th source block lands in the
i-th destination block (same token positions), whatever their physical ids. A
``Segment`` is every part (K and V, or a latent cache's row) of positions ``[start,
start + count)`` of that list, for one layer and one range of global units (KV heads,
or latent row columns: ``KVLayout.unit_view``): the one record both sides and both
wires speak of (gloo encodes it as an int64 header row, grpc as a ``KVChunkMeta``). A
sender reads segments out of its cache through a ``Source``; a receiver writes them
with ``scatter``. Every tensor here is in the unit view: ``[..., blocks, block_size,
units, unit_dim]``.

The checksum (``checksum``) is a wrapping 64-bit sum of a segment's bytes read as
int64 words: one read at memory bandwidth, on the device for device tensors, and it
sees any flipped bit and lost, zeroed or truncated bytes; not two whole words trading
places (ordering is the in-order transports' job, and the bit-exact tests').
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.kv_transfer.layout import KVLayout

_MASK = (1 << 64) - 1
_WORDS = ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2), (torch.uint8, 1))
_WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True, slots=True)
class Segment:
    """Every part of block positions ``[start, start + count)``, one layer, global units
    ``heads`` (KV heads, or latent row columns)."""

    layer: int
    start: int
    count: int
    heads: tuple[int, int]

    @property
    def num_heads(self) -> int:
        return self.heads[1] - self.heads[0]


def runs(ids: Sequence[int]) -> list[tuple[int, int]]:
    """``(index, length)`` of each run of consecutive ids."""
    out, i = [], 0
    while i < len(ids):
        j = i + 1
        while j < len(ids) and ids[j] == ids[j - 1] + 1:
            j += 1
        out.append((i, j - i))
        i = j
    return out


def plan_positions(ids: Sequence[int], max_blocks: int, min_run: int = 4) -> list[tuple[int, int]]:
    """Cut a block list into ``(start, count)`` pieces of at most ``max_blocks``: runs of at
    least ``min_run`` consecutive ids stay runs (sent without a copy); shorter runs are
    grouped with their neighbours (gathered into one buffer)."""
    out: list[tuple[int, int]] = []
    group = [0, 0]  # start, length of the strays gathered so far

    def flush():
        start, n = group
        for s in range(start, start + n, max_blocks):
            out.append((s, min(max_blocks, start + n - s)))
        group[1] = 0

    for start, length in runs(ids):
        if length >= min_run:
            flush()
            for s in range(start, start + length, max_blocks):
                out.append((s, min(max_blocks, start + length - s)))
            continue
        if group[1] == 0:
            group[0] = start
        group[1] += length
        if group[1] >= max_blocks:
            flush()
    flush()
    return out


def plan_segments(
    ids: Sequence[int],
    offset: int,
    skips: dict[int, int],
    heads: tuple[int, int],
    max_blocks: int,
    min_run: int = 4,
) -> list[Segment]:
    """The segments of one send call: source blocks ``ids`` at positions ``offset ..`` of
    the request's list, for each layer of ``skips`` (layer -> the leading positions of
    the list it does not receive, ``KVDestination.skip``). The positions are cut where
    a layer starts receiving, each piece planned by ``plan_positions`` and sent to every
    layer that receives it; the segments go position by position, each for its layers
    in ``skips``' order (backends copy consecutive layers at one position at once)."""
    cuts = sorted({0, len(ids)} | {min(max(0, s - offset), len(ids)) for s in skips.values()})
    out = []
    for a, b in zip(cuts, cuts[1:], strict=False):
        for start, count in plan_positions(ids[a:b], max_blocks, min_run):
            at = offset + a + start
            out += [Segment(n, at, count, heads) for n, skip in skips.items() if skip <= at]
    return out


def is_run(ids: Sequence[int]) -> bool:
    return all(ids[k] == ids[0] + k for k in range(len(ids)))


def _heads(cache: torch.Tensor, heads: tuple[int, int]) -> torch.Tensor:
    return cache if heads == (0, cache.shape[-2]) else cache[..., heads[0] : heads[1], :]


def gather(cache: torch.Tensor, ids: Sequence[int], heads: tuple[int, int], out: torch.Tensor):
    """Copy blocks ``ids``, local units ``[h0, h1)`` of one part's cache ``[..., blocks,
    block_size, units, dim]`` (one layer's, or several layers' parts) into ``out``
    ``[..., len(ids), block_size, h1-h0, dim]``."""
    dim, src = cache.dim() - 4, _heads(cache, heads)
    if is_run(ids):
        return out.copy_(src.narrow(dim, ids[0], len(ids)))
    idx = torch.tensor(ids, dtype=torch.int64, device=cache.device)
    return torch.index_select(src, dim, idx, out=out)


def scatter(cache: torch.Tensor, ids: Sequence[int], heads: tuple[int, int], data: torch.Tensor):
    """Write ``data`` ``[..., len(ids), block_size, h1-h0, dim]`` into blocks ``ids``, local
    units ``[h0, h1)`` of one part's cache ``[..., blocks, block_size, units, dim]``."""
    dim, dst = cache.dim() - 4, _heads(cache, heads)
    if is_run(ids):
        dst.narrow(dim, ids[0], len(ids)).copy_(data)
    elif cache.device.type == "cpu" and cache.element_size() in _WORD:
        # numpy's indexed assignment copies whole blocks (docs/kv_transfer.md, "Things learned")
        word = _WORD[cache.element_size()]
        dst.view(word).numpy()[(slice(None),) * dim + (np.asarray(ids),)] = data.view(word).numpy()
    else:
        dst.index_copy_(dim, torch.tensor(ids, dtype=torch.int64, device=cache.device), data)


@dataclass(eq=False)
class Source:
    """Where one send call's segments are read from: ``layers`` (layer -> this rank's
    part views ``[blocks, block_size, local units, unit_dim]``: K and V, or the latent
    row), the rank's whole cache in the unit view when they are its layers (several
    layers are then copied at once), the call's source block ids (positions ``offset``
    on) and the rank's layout (global units to its own)."""

    layers: dict[int, tuple[torch.Tensor, ...]]
    kv_cache: torch.Tensor | None
    ids: list[int]
    offset: int
    layout: KVLayout

    def ids_of(self, seg: Segment) -> list[int]:
        return self.ids[seg.start - self.offset : seg.start - self.offset + seg.count]

    def local(self, seg: Segment) -> tuple[int, int]:
        return self.layout.local(seg.heads)

    def full(self, seg: Segment) -> bool:
        return self.local(seg) == (0, self.layers[seg.layer][0].shape[-2])

    def shape(self, seg: Segment) -> tuple[int, ...]:
        k = self.layers[seg.layer][0]
        return (seg.count, k.shape[1], seg.num_heads, k.shape[-1])

    def views(self, seg: Segment) -> tuple[torch.Tensor, ...] | None:
        """Each part as a view of the cache, when each is one region of it."""
        ids = self.ids_of(seg)
        if not (self.full(seg) and is_run(ids)):
            return None
        return tuple(part[ids[0] : ids[0] + seg.count] for part in self.layers[seg.layer])

    def pieces(self, seg: Segment) -> list[torch.Tensor] | None:
        """Each part's bytes in turn (K's then V's) as contiguous views of the cache, one
        per run of consecutive ids (None when units are partial)."""
        if not self.full(seg):
            return None
        ids, out = self.ids_of(seg), []
        for cache in self.layers[seg.layer]:
            out += [cache[ids[i] : ids[i] + n] for i, n in runs(ids)]
        return out

    def gather(self, seg: Segment, outs: Sequence[torch.Tensor]) -> None:
        """Copy the segment's parts into ``outs``, one ``shape(seg)`` tensor per part."""
        ids, heads = self.ids_of(seg), self.local(seg)
        for part, out in zip(self.layers[seg.layer], outs, strict=True):
            gather(part, ids, heads, out)

    def gather_layers(self, segs: Sequence[Segment], out: torch.Tensor) -> bool:
        """Copy consecutive layers at one position into ``out`` ``[layers, parts, count,
        block_size, units, dim]`` with one copy; False when they are not one cache's."""
        if self.kv_cache is None or len(segs) < 2:
            return False
        first = segs[0].layer
        gather(
            self.kv_cache[first : first + len(segs)], self.ids_of(segs[0]), self.local(segs[0]), out
        )
        return True


def checksum(*parts: torch.Tensor) -> int:
    """The wrapping sum of the parts' bytes as words, as an unsigned 64-bit int.

    Each part must be contiguous. The word width depends on a part's byte count alone (8
    bytes, or narrower when the size is not a multiple of 8), so both ends agree
    whatever the alignment of their buffers."""
    total = 0
    for t in parts:
        flat = t.reshape(-1).view(torch.uint8)
        word = next(w for w, size in _WORDS if flat.numel() % size == 0)
        try:
            words = flat.view(word)
        except RuntimeError:  # storage offset not a multiple of the word
            words = flat.clone().view(word)
        total += int(words.sum(dtype=torch.int64))
    return total & _MASK


class BufferPool:
    """Reusable byte buffers: freshly allocated large tensors cost a page fault per 4 KiB
    on first touch, more than the copy itself. Sizes round up to powers of two."""

    def __init__(self, device: torch.device | str = "cpu", keep_bytes: int = 1 << 30):
        self.device, self.keep_bytes = torch.device(device), keep_bytes
        self._free: dict[int, list[torch.Tensor]] = {}
        self._kept = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of at least ``nbytes`` (its first ``nbytes`` are for the caller)."""
        size = max(1 << 16, 1 << (max(nbytes, 1) - 1).bit_length())
        with self._lock:
            if self._free.get(size):
                self._kept -= size
                return self._free[size].pop()
        return torch.empty(size, dtype=torch.uint8, device=self.device)

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            if self._kept + buf.numel() <= self.keep_bytes:
                self._free.setdefault(buf.numel(), []).append(buf)
                self._kept += buf.numel()


def typed(buf: torch.Tensor, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """The first bytes of uint8 ``buf`` viewed as a ``dtype`` tensor of ``shape``."""
    n = int(np.prod(shape)) * dtype.itemsize
    return buf[:n].view(dtype).view(*shape)
