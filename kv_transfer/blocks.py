"""Block mapping between the pools' paged caches: which blocks travel together, and the
copies out of the source cache and into the destination cache.

A request's KV is a list of blocks in each pool; the i-th source block lands in the
i-th destination block (same token positions), whatever their physical ids. Each
message carries a *segment*: a run of positions ``[start, start + count)`` of that list,
for one layer, K or V, and one head range. The sender sends a run of physically
contiguous source blocks holding all of its heads straight from the cache (no copy);
anything else is gathered into one buffer first. The receiver copies a segment into
its cache with a slice copy when the destination blocks are contiguous, an indexed
copy otherwise.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

_WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class Segment:
    """Positions ``[start, start + count)`` of the request's block list (after the call's
    block offset); ``contiguous`` when their source ids are consecutive."""

    start: int
    count: int
    contiguous: bool


def plan_segments(
    block_ids: Sequence[int], max_blocks: int, min_run: int = 4, offset: int = 0
) -> list[Segment]:
    """Cut a block list into segments of at most ``max_blocks`` blocks: runs of at least
    ``min_run`` consecutive ids stay runs (sent without a copy); shorter runs are grouped
    with their neighbours (gathered into one buffer)."""
    if max_blocks < 1:
        raise ValueError(f"max_blocks={max_blocks} must be >= 1")
    runs: list[tuple[int, int]] = []  # (start, length) of consecutive ids
    i, n = 0, len(block_ids)
    while i < n:
        j = i + 1
        while j < n and block_ids[j] == block_ids[j - 1] + 1:
            j += 1
        runs.append((i, j - i))
        i = j
    out: list[Segment] = []
    group_start, group_len = 0, 0

    def flush():
        nonlocal group_len
        s = group_start
        while group_len > 0:
            c = min(group_len, max_blocks)
            out.append(Segment(offset + s, c, False))
            s, group_len = s + c, group_len - c

    for start, length in runs:
        if length >= min_run:
            flush()
            for s in range(start, start + length, max_blocks):
                c = min(max_blocks, start + length - s)
                out.append(Segment(offset + s, c, True))
        else:
            if group_len == 0:
                group_start = start
            group_len += length
            if group_len >= max_blocks:
                flush()
    flush()
    return out


def is_run(ids: Sequence[int]) -> bool:
    return all(ids[k] == ids[0] + k for k in range(len(ids)))


def full_heads(cache: torch.Tensor, heads: tuple[int, int]) -> bool:
    return heads[0] == 0 and heads[1] == cache.shape[-2]


def _heads(cache: torch.Tensor, heads: tuple[int, int]) -> torch.Tensor:
    return cache if full_heads(cache, heads) else cache[..., heads[0] : heads[1], :]


def gather(
    cache: torch.Tensor,
    ids: Sequence[int],
    heads: tuple[int, int],
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Blocks ``ids`` of a K (or V) cache ``[..., blocks, block_size, heads, dim]`` (one
    layer's, or several layers' K and V), heads ``[h0, h1)``, as one contiguous
    ``[..., len(ids), block_size, h1-h0, dim]`` tensor.

    Without ``out``, a consecutive run that is one region of the cache (all heads, one
    layer) is returned as a view of it (no copy); with ``out``, the blocks are always
    copied into it.
    """
    n, dim = len(ids), cache.dim() - 4
    src = _heads(cache, heads)
    if is_run(ids):
        view = src.narrow(dim, ids[0], n)
        if out is not None:
            return out.copy_(view)
        return view.contiguous()  # a view when the run is one region of the cache
    idx = torch.tensor(ids, dtype=torch.int64, device=cache.device)
    if out is None:
        return src.index_select(dim, idx)
    return torch.index_select(src, dim, idx, out=out)


def scatter(
    cache: torch.Tensor, ids: Sequence[int], heads: tuple[int, int], data: torch.Tensor
) -> None:
    """Write ``data`` ``[..., len(ids), block_size, h1-h0, dim]`` into blocks ``ids``,
    heads ``[h0, h1)`` of a K (or V) cache ``[..., blocks, block_size, heads, dim]``."""
    dim = cache.dim() - 4
    dst = _heads(cache, heads)
    if is_run(ids):
        dst.narrow(dim, ids[0], len(ids)).copy_(data)
    elif cache.device.type == "cpu" and cache.element_size() in _WORD:
        # numpy's indexed assignment copies whole blocks (index_copy_ is ~3x slower)
        word = _WORD[cache.element_size()]
        dst.view(word).numpy()[(slice(None),) * dim + (np.asarray(ids),)] = data.view(word).numpy()
    else:
        idx = torch.tensor(ids, dtype=torch.int64, device=cache.device)
        dst.index_copy_(dim, idx, data)


class BufferPool:
    """Reusable byte buffers: freshly allocated large tensors cost a page fault per 4 KiB
    on first touch, more than the copy itself. Sizes round up to powers of two."""

    def __init__(self, device: torch.device | str = "cpu", keep_bytes: int = 1 << 30):
        self.device = torch.device(device)
        self.keep_bytes = keep_bytes
        self._free: dict[int, list[torch.Tensor]] = {}
        self._kept = 0
        self._lock = threading.Lock()

    @staticmethod
    def _size_class(nbytes: int) -> int:
        return max(1 << 16, 1 << (max(nbytes, 1) - 1).bit_length())

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of at least ``nbytes`` (its first ``nbytes`` are for the caller)."""
        size = self._size_class(nbytes)
        with self._lock:
            bucket = self._free.get(size)
            if bucket:
                self._kept -= size
                return bucket.pop()
        return torch.empty(size, dtype=torch.uint8, device=self.device)

    def give(self, buf: torch.Tensor) -> None:
        size = buf.numel()
        with self._lock:
            if self._kept + size <= self.keep_bytes:
                self._free.setdefault(size, []).append(buf)
                self._kept += size


def typed(buf: torch.Tensor, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """The first bytes of uint8 ``buf`` viewed as a ``dtype`` tensor of ``shape``."""
    n = 1
    for s in shape:
        n *= s
    return buf[: n * dtype.itemsize].view(dtype).view(*shape)
