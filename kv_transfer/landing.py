"""The data plane of the receiver's book: claims on segments, and their writes into the
cache. A claim is taken before a segment's bytes can reach the cache (before its receive
is posted straight into it, or before its copy out of staging), and ended by a commit;
dropping a transfer waits for its claims (``TransferBook``), so no byte lands after."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kv_transfer.blocks import full_heads, scatter
from kv_transfer.errors import KVTransferError
from kv_transfer.layout import KVLayout
from kv_transfer.pending import Claim, Pending, Status, status_of

# a piece to claim: (layer, kv, start, count, heads, shape of its data)
Piece = tuple[int, int, int, int, tuple[int, int], tuple[int, ...]]


class Landing:
    """Claims and writes; mixed into ``TransferBook`` (``_cond``, ``_by_key``,
    ``layout``, ``kv_cache``, ``layer_caches``)."""

    def claim(
        self,
        key: int,
        src_rank: int,
        src_layout: KVLayout,
        layer: int,
        kv: int,
        start: int,
        count: int,
        heads: tuple[int, int],
        shape: tuple[int, ...],
        on_stuck: Callable[[], None] | None = None,
    ) -> tuple[Claim | None, Status, str]:
        """The right to write one segment (``shape`` = ``[count, block_size, heads, dim]``)
        into the cache: ``None`` with the status to acknowledge when its transfer is not
        expected or the segment does not fit it. Until ``commit``, dropping the transfer
        waits for this write; if the write hangs (a stalled sender), ``on_stuck`` is called
        to break it (it must make the write fail, e.g. by aborting the connection)."""
        with self._cond:
            claims, status, text = self._claim(
                key, src_rank, src_layout, [(layer, kv, start, count, heads, shape)], on_stuck
            )
        return (claims[0] if claims else None), status, text

    def claim_many(
        self,
        key: int,
        src_rank: int,
        src_layout: KVLayout,
        pieces: Sequence[Piece],
        on_stuck: Callable[[], None] | None = None,
    ) -> list[Claim] | None:
        """``claim`` for several pieces of one transfer from one source rank, all or none."""
        with self._cond:
            return self._claim(key, src_rank, src_layout, pieces, on_stuck)[0]

    def target(self, c: Claim) -> torch.Tensor | None:
        """The cache region a claimed segment fills, when it is one contiguous tensor
        (consecutive destination blocks, all of this rank's heads): receive into it."""
        if not c.pending.is_run(c.start, c.count):
            return None
        cache = self.layer_caches[c.layer][c.kv]
        if not full_heads(cache, c.route.dst_heads):
            return None
        first = c.pending.dst_block_ids[c.start]
        return cache[first : first + c.count]

    def write(self, c: Claim, data: torch.Tensor) -> None:
        """Copy a claimed segment into its blocks (indexed copy when they are scattered)."""
        ids = c.pending.dst_block_ids[c.start : c.start + c.count]
        scatter(self.layer_caches[c.layer][c.kv], ids, c.route.dst_heads, data)

    def write_layers(self, claims: Sequence[Claim], data: torch.Tensor) -> None:
        """Copy ``data`` ``[layers, 2, count, block_size, heads, dim]`` in one go: the
        claims are K and V, in that order, of consecutive layers at one block position."""
        c = claims[0]
        ids = c.pending.dst_block_ids[c.start : c.start + c.count]
        layers = self.kv_cache[c.layer : c.layer + len(claims) // 2]
        scatter(layers, ids, c.route.dst_heads, data)

    def commit(self, c: Claim, ok: bool) -> None:
        """End a claim: when ``ok``, its blocks count as landed."""
        self.commit_many([c], ok)

    def commit_many(self, claims: Sequence[Claim], ok: bool) -> None:
        """``commit`` for several claims."""
        with self._cond:
            by_transfer: dict[int, list[Claim]] = {}
            for c in claims:
                c.pending.inflight -= 1
                c.pending.claims.discard(c)
                by_transfer.setdefault(id(c.pending), []).append(c)
            for group in by_transfer.values():
                p = group[0].pending
                if ok and not p.dropped:
                    p.land(group)
            self._cond.notify_all()

    def deliver(
        self,
        key: int,
        src_rank: int,
        src_layout: KVLayout,
        layer: int,
        kv: int,
        start: int,
        count: int,
        heads: tuple[int, int],
        data: torch.Tensor,
        sync: Callable[[], None] | None = None,
    ) -> tuple[Status, str]:
        """Claim, copy and commit one segment that is already in memory. ``sync`` (device
        caches) runs after the copy, before the piece counts as landed."""
        if data.dtype != self.layout.torch_dtype:
            shape: tuple[int, ...] = ()  # refused by check_segment
        else:
            shape = tuple(data.shape)
        c, status, text = self.claim(
            key, src_rank, src_layout, layer, kv, start, count, heads, shape
        )
        if c is None:
            return status, text
        ok = False
        try:
            self.write(c, data)
            if sync is not None:
                sync()
            ok = True
        finally:
            self.commit(c, ok)
        return Status.OK, ""

    def _claim(self, key, src_rank, src_layout, pieces, on_stuck):
        """(claims or None, status, text), lock held."""
        p: Pending | None = self._by_key.get(key)
        if p is None:
            return None, Status.UNKNOWN, "transfer not expected (never, or no longer)"
        if p.error is not None:
            return None, Status(status_of(p.error)), str(p.error)
        same = src_layout is p.checked_layout
        checked = set()  # pieces differing only in layer and kv: the layer is checked alone
        for layer, kv, start, count, heads, shape in pieces:
            if (start, count, heads, shape) in checked:
                ok = 0 <= layer < self.layout.num_layers and kv in (0, 1)
                problem = "" if ok else f"layer {layer} / kv {kv} is outside the cache"
            else:
                problem = p.check_segment(
                    self.layout, src_rank, src_layout, layer, kv, start, count, heads, shape, same
                )
                checked.add((start, count, heads, shape))
            if problem:
                p.error = KVTransferError(f"transfer {p.transfer_id!r} rejected: {problem}")
                self._cond.notify_all()
                return None, Status.REJECTED, problem
            same = True
        p.checked_layout = src_layout
        route = p.routes[src_rank]
        claims = [
            Claim(p, src_rank, layer, kv, start, count, route, on_stuck)
            for layer, kv, start, count, _, _ in pieces
        ]
        p.inflight += len(claims)
        p.claims.update(claims)
        return claims, Status.OK, ""
