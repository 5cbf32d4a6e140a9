"""Reading one pair on the receiver: headers in order, each batch's receives posted as
soon as its header arrives (its pack into staging, its direct segments straight into the
cache where they fit), and a second thread completing them in the same order (checksum,
copy out of staging, bookkeeping, ACK), so data keeps flowing while earlier batches are
copied.

gloo matches messages per tag, so ``slots`` header receives are posted ahead; NCCL
matches in order whatever the tag, so there the next header receive follows the batch's.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading

import torch

from kv_transfer.blocks import typed
from kv_transfer.checksum import checksum, combine
from kv_transfer.errors import KVChecksumError
from kv_transfer.gloo import wire
from kv_transfer.gloo.group import FOREVER
from kv_transfer.gloo.wire import (
    H_KEY,
    H_PACK,
    H_SRC_RANK,
    NOT_PACKED,
    S_COUNT,
    S_HAS_SUM,
    S_HEAD0,
    S_HEAD1,
    S_LAYER,
    S_NBYTES,
    S_OFFSET,
    S_START,
    S_SUM,
    Kind,
)

log = logging.getLogger(__name__)


class PairReader:
    """The receiving end of one pair: ``serve`` runs in the pair's thread until the
    sender says BYE or the connection breaks."""

    def __init__(self, receiver, pair, pg):
        self.pair, self.pg = pair, pg
        self.book, self.pool, self.layout = receiver.book, receiver.pool, receiver.layout
        self.group, self.timeout = receiver.group, receiver.connect_timeout
        self.slots, self.pack_bytes = receiver.slots, receiver.pack_bytes
        self.address, self.backend = receiver.address, receiver.backend
        self.dev = self.group.device_type

    def serve(self) -> None:
        pg, tagged = self.pg, self.group.tagged
        done: queue.SimpleQueue = queue.SimpleQueue()
        completer = threading.Thread(
            target=self._complete,
            args=(done,),
            name=f"kv-{self.backend}-done-{self.pair.key[0]}-{self.pair.key[1]}",
            daemon=True,
        )
        completer.start()
        headers: collections.deque = collections.deque()
        for _ in range(self.slots if tagged else 1):
            hdr = torch.empty(wire.HDR_LEN, dtype=torch.int64, device=self.dev)
            headers.append((pg.recv([hdr], 0, wire.TAG_HDR), hdr))
        try:
            while True:
                work, hdr = headers.popleft()
                self.pair.waiting = work
                work.wait(FOREVER)
                h = hdr.tolist()
                if tagged:
                    headers.append((pg.recv([hdr], 0, wire.TAG_HDR), hdr))
                if h[wire.H_MAGIC] != wire.MAGIC:
                    raise RuntimeError(f"bad header magic {h[wire.H_MAGIC]:#x}")
                kind = h[wire.H_KIND]
                if kind == Kind.DATA:
                    done.put(self._post_batch(h))
                elif kind in (Kind.END, Kind.BYE):
                    done.put((kind, h, None, None, None))
                    if kind == Kind.BYE:
                        return
                else:
                    raise RuntimeError(f"unknown header kind {kind}")
                if not tagged:
                    headers.append((pg.recv([hdr], 0, wire.TAG_HDR), hdr))
        finally:
            done.put(None)
            completer.join()

    # -- posting (the pair's thread) -----------------------------------------------------
    def _post_batch(self, h: list[int]):
        """Check a DATA header's rows, post its pack's receive, then claim the direct
        segments and post their K and V receives, in the order the sender sends."""
        rows = wire.rows(h)
        size = h[H_PACK]
        lay = self.layout
        for seg in rows:
            count, heads, nbytes = seg[S_COUNT], (seg[S_HEAD0], seg[S_HEAD1]), seg[S_NBYTES]
            if count < 1 or nbytes != count * lay.block_bytes(heads[1] - heads[0]):
                raise RuntimeError(f"{nbytes} bytes do not make a segment of {count} blocks")
            if seg[S_OFFSET] != NOT_PACKED and not 0 <= seg[S_OFFSET] <= size - 2 * nbytes:
                raise RuntimeError(f"segment at {seg[S_OFFSET]} outside a pack of {size} bytes")
        if size > self.pack_bytes:
            raise RuntimeError(f"a pack of {size} bytes exceeds {self.pack_bytes}")
        pack = self._post_pack(size) if size else None
        direct = [seg for seg in rows if seg[S_OFFSET] == NOT_PACKED]
        return Kind.DATA, h, rows, pack, self._post_direct(h, direct) if direct else []

    def _post_direct(self, h: list[int], rows: list[list[int]]) -> list:
        """Claim the segments sent on their own and post their K and V receives: straight
        into the cache when the blocks are consecutive there and hold all of this rank's
        heads, into staging otherwise (or when nothing expects them)."""
        pieces = self._pieces(rows)
        claims = self.book.claim_many(
            h[H_KEY], h[H_SRC_RANK], self.pair.layout, pieces, on_stuck=self.pair.break_
        )
        items = []
        for i, piece in enumerate(pieces):
            claim = claims[i] if claims else None
            target = None if claim is None else self.book.target(claim)
            buf = None
            if target is None:  # scattered blocks, or nowhere to go: receive into staging
                buf = self.pool.take(rows[i // 2][S_NBYTES])
                target = typed(buf, self.layout.torch_dtype, piece[5])
            items.append((claim, target, buf, self.pg.recv([target], 0, wire.TAG_DATA)))
        return items

    def _post_pack(self, size: int) -> list:
        """A pack receive: [work, staging buffer]."""
        buf = self.pool.take(size)
        return [self.pg.recv([buf[:size]], 0, wire.TAG_PACK), buf]

    def _pieces(self, rows: list[list[int]]) -> list:
        """K and V of each row, as the book claims them."""
        lay = self.layout
        out = []
        for seg in rows:
            count, heads = seg[S_COUNT], (seg[S_HEAD0], seg[S_HEAD1])
            shape = (count, lay.block_size, heads[1] - heads[0], lay.head_dim)
            out += [(seg[S_LAYER], kv, seg[S_START], count, heads, shape) for kv in (0, 1)]
        return out

    # -- completing (the completer thread) -----------------------------------------------
    def _complete(self, done: queue.SimpleQueue) -> None:
        broken = False
        while (item := done.get()) is not None:
            kind, h, rows, pack, direct = item
            if kind == Kind.DATA:
                broken = self._complete_batch(h, rows, pack, direct, broken)
            elif kind == Kind.END and not broken:
                try:
                    self._ack(h)
                except Exception:  # noqa: BLE001 - the pair is gone
                    broken = True

    def _complete_batch(self, h, rows, pack, direct, broken: bool) -> bool:
        """Land one batch: its pack, then its direct segments, in the order they arrive;
        returns whether the pair broke."""
        sync = self.group.sync if self.dev != "cpu" else None
        if pack is not None:
            broken = broken or not self._waited(pack[0])
            if not broken:
                self._land_pack(h, [seg for seg in rows if seg[S_OFFSET] >= 0], pack[1], sync)
                self.pool.give(pack[1])
        if direct:  # receives of one tag complete in order: the last one implies all
            ok = not broken and self._waited(direct[-1][3])
            broken = broken or not ok
            segs = [seg for seg in rows if seg[S_OFFSET] == NOT_PACKED]
            if ok and any(seg[S_HAS_SUM] for seg in segs):
                sums = [self._checksum_ok(h, seg, [t for _, t, _, _ in direct[2 * i : 2 * i + 2]])
                        for i, seg in enumerate(segs)]  # fmt: skip
                ok = all(sums)
            self._land_direct(direct, ok, sync)
        return broken

    def _waited(self, work) -> bool:
        try:
            work.wait(self.timeout)
            return True
        except Exception:  # noqa: BLE001 - the pair is gone; the pair's thread sees it too
            return False

    def _land_direct(self, items, ok: bool, sync) -> None:
        landed, failed = [], []
        for claim, target, buf, _ in items:
            if claim is not None:
                if ok and buf is not None:
                    try:
                        self.book.write(claim, target)
                    except Exception:  # noqa: BLE001
                        log.exception("KV receiver %s: copy failed", self.address)
                        failed.append(claim)
                        continue
                (landed if ok else failed).append(claim)
            if buf is not None:
                self.pool.give(buf)
        if landed and sync is not None:
            sync()
        self._commit(landed, failed)

    def _land_pack(self, h, rows: list[list[int]], buf: torch.Tensor, sync) -> None:
        """Claim, check and copy the packed segments; consecutive layers at one block
        position are claimed together and copied with one (indexed) copy."""
        keys = [(seg[S_LAYER], seg[S_START], seg[S_COUNT], seg[S_HEAD0], seg[S_OFFSET],
                 seg[S_NBYTES]) for seg in rows]  # fmt: skip
        dtype = self.layout.torch_dtype
        for i, j in wire.layer_spans(keys):
            seg = rows[i]
            pieces = self._pieces(rows[i:j])
            claims = self.book.claim_many(h[H_KEY], h[H_SRC_RANK], self.pair.layout, pieces)
            if not claims:
                continue  # not expected (any more): dropped
            data = typed(buf[seg[S_OFFSET] :], dtype, (j - i, 2, *pieces[0][5]))
            ok = all(
                self._checksum_ok(h, rows[r], data[r - i].unbind(0))
                for r in range(i, j)
                if rows[r][S_HAS_SUM]
            )
            try:
                if ok:
                    self.book.write_layers(claims, data)
                    if sync is not None:
                        sync()
            except Exception:  # noqa: BLE001
                log.exception("KV receiver %s: copy failed", self.address)
                ok = False
            self._commit(claims if ok else [], [] if ok else claims)

    def _commit(self, landed: list, failed: list) -> None:
        if landed:
            self.book.commit_many(landed, True)
        if failed:
            self.book.commit_many(failed, False)

    def _checksum_ok(self, h, seg, parts) -> bool:
        """Whether K and V (``parts``) sum to what the sender sent; fails the transfer
        when not."""
        got = combine(*(checksum(p) for p in parts))
        if got == wire.unsigned(seg[S_SUM]):
            return True
        key = h[H_KEY]
        tid = self.book.transfer_id_of(key) or f"key {key:#x}"
        start = seg[S_START]
        self.book.fail(
            key,
            KVChecksumError(
                f"KV transfer {tid!r}: checksum mismatch in layer {seg[S_LAYER]}, "
                f"blocks [{start}, {start + seg[S_COUNT]}) from source rank "
                f"{h[H_SRC_RANK]} ({self.pair.key[0]}): sent {wire.unsigned(seg[S_SUM]):#018x}, "
                f"received {got:#018x}"
            ),
        )
        return False

    def _ack(self, h: list[int]) -> None:
        status, text = self.book.source_status(h[H_KEY], h[H_SRC_RANK])
        ack = torch.tensor(wire.ack(h[H_KEY], h[H_SRC_RANK], int(status), text), device=self.dev)
        self.pg.send([ack], 0, wire.TAG_ACK).wait(self.timeout)
