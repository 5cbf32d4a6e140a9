"""Prefill side of the ``gloo`` and ``nccl`` backends: a pair per decode rank, formed
on first contact (``send_pair.py``); batches of segments (``batches.py``) sent as a
header, then the batch's pack and its direct K and V messages."""

from __future__ import annotations

import collections
import contextlib
import datetime
import os
import threading
import time

import torch

from kv_transfer.blocks import typed
from kv_transfer.checksum import checksum, combine
from kv_transfer.errors import KVPeerError, KVTransferError, KVTransferTimeout
from kv_transfer.gloo import wire
from kv_transfer.gloo.batches import Batch, fill_pack, plan_batches
from kv_transfer.gloo.group import FOREVER, GlooGroup, NcclGroup, abort
from kv_transfer.gloo.send_pair import SendPair, connect
from kv_transfer.gloo.wire import NOT_PACKED, Kind
from kv_transfer.head_map import HeadRoute
from kv_transfer.layout import KVLayout
from kv_transfer.outgoing import Outgoing, SegmentOut
from kv_transfer.pending import Status
from kv_transfer.sender import Ack, KVSender


class GlooSender(KVSender):
    """Prefill side over torch.distributed point-to-point (gloo on CPU)."""

    backend = "gloo"
    group = GlooGroup

    def __init__(
        self,
        layout: KVLayout,
        *,
        host: str | None = None,
        connect_timeout: float = 30.0,
        pack_below: int = 128 << 10,
        pack_bytes: int = 4 << 20,
        pack_window: int = 4,
        verify_idle_s: float = 1.0,
        batch_bytes: int | None = None,
        **kwargs,
    ):
        self.device_type = self.group.device_type
        super().__init__(layout, **kwargs)
        self.pack_below = pack_below  # K (or V) parts under this are packed, not sent alone
        self.pack_bytes = pack_bytes  # most bytes in one pack (the receiver may ask for less)
        self.pack_window = max(1, pack_window)  # packs of a transfer on their way at once
        # a pair acknowledged this recently is not asked whether its receiver restarted
        self.verify_idle_s = verify_idle_s
        # data under one header (None: as much as fits); 4 MiB with checksums by default,
        # since the sums are taken before the header goes and checked once the batch landed
        self.batch_bytes = 4 << 20 if batch_bytes is None and self.checksum else batch_bytes
        self.host = host or os.environ.get("PDSERVE_KV_HOST", "127.0.0.1")
        self.connect_timeout = datetime.timedelta(seconds=connect_timeout)
        self._pairs: dict[str, SendPair] = {}
        self._pairs_lock = threading.Lock()

    # -- pairs -------------------------------------------------------------------------
    def _pair(self, address: str, dst_rank: int, verify: bool = False) -> SendPair:
        """The pair with ``address``, formed on first use; rebuilt when it broke, or (with
        ``verify``, once per transfer, unless the pair was acknowledged within
        ``verify_idle_s``) when the receiver behind the address restarted."""
        with self._pairs_lock:
            pair = self._pairs.get(address)
            if pair is not None and pair.broken is None:
                recent = time.monotonic() - pair.acked_at < self.verify_idle_s
                if not verify or recent or pair.alive():
                    return pair
                pair.broken = KVPeerError(f"KV receiver {address} restarted")
            if pair is not None:
                self._pairs.pop(address)
                abort(pair.pg)
            pair = connect(self, address, dst_rank)
            self._pairs[address] = pair
            return pair

    def _transfer_pair(self, t: Outgoing, address: str, dst_rank: int) -> SendPair:
        """The pair a transfer uses for ``address``, checked on the transfer's first use."""
        pairs = t.extra.setdefault("pairs", {})
        pair = pairs.get(address)
        if pair is None:
            pair = pairs[address] = self._pair(address, dst_rank, verify=True)
        return pair

    def _broken(self, pair: SendPair, error: Exception) -> KVPeerError:
        pair.broken = error
        abort(pair.pg)
        return KVPeerError(f"connection to KV receiver {pair.address} lost: {error}")

    # -- data --------------------------------------------------------------------------
    def _part_limit(self, t: Outgoing, address: str, dst_rank: int) -> int:
        return min(self.part_bytes, self._transfer_pair(t, address, dst_rank).pack_bytes // 2)

    def _post_segments(
        self, t: Outgoing, route: HeadRoute, address: str, segments: list[SegmentOut]
    ) -> None:
        pair = self._transfer_pair(t, address, route.dst_rank)
        for batch in plan_batches(segments, pair.pack_bytes, self.pack_below, self.batch_bytes):
            self._post_batch(t, route, address, batch)

    def _post_batch(self, t: Outgoing, route: HeadRoute, address: str, batch: Batch) -> None:
        """Gather the batch's pack, then send its header, the pack and the direct parts.
        gloo's own thread writes them once the receiver has posted its receives, so the
        next pack is gathered while this one travels."""
        h = wire.header(Kind.DATA, t.key, self.layout.tp_rank)
        h[wire.H_NSEGS], h[wire.H_PACK] = len(batch.rows), batch.pack_bytes
        pack = self._take_pack(t, batch.pack_bytes) if batch.pack_bytes else None
        if pack is not None:
            fill_pack(pack, [(seg, off) for seg, off in batch.rows if off != NOT_PACKED])
        direct: list[torch.Tensor] = []
        heads, has_sum = route.heads, int(self.checksum)
        for i, (seg, offset) in enumerate(batch.rows):
            nbytes, total = seg.nbytes, 0
            corrupt = self._take_corruption()
            if offset == NOT_PACKED or has_sum or corrupt:
                k, v = self._parts(t, seg, pack, offset)
                total = combine(checksum(k), checksum(v)) if has_sum else 0
                if corrupt:  # testing aid: one bit off after the checksum
                    if offset == NOT_PACKED:
                        k = k.clone()
                    k.view(-1).view(torch.uint8)[0] ^= 1
                if offset == NOT_PACKED:
                    direct += [k, v]
            row = 8 + wire.ROW * i
            h[row : row + wire.ROW] = [
                seg.layer, seg.start, seg.count, heads[0], heads[1], nbytes, has_sum,
                wire.signed(total), offset,
            ]  # fmt: skip
        hdr = torch.tensor(h, dtype=torch.int64, device=self.device_type)
        messages = [(hdr, wire.TAG_HDR, None)]
        if pack is not None:
            messages.append((pack[: batch.pack_bytes], wire.TAG_PACK, pack))
        messages += [(part, wire.TAG_DATA, None) for part in direct]
        pair = t.extra["pairs"][address]
        used = t.extra.setdefault("used", set())
        try:
            self._send(t, pair, messages)
        except KVPeerError:
            if address in used:
                raise
            # nothing of this transfer went there yet: the receiver restarted since the
            # pair last answered (not checked then, see _pair); join it again and resend
            t.extra["sends"] = [s for s in t.extra["sends"] if s[0] is not pair]
            t.extra["packs"] = collections.deque(p for p in t.extra["packs"] if p[0] is not pair)
            pair = t.extra["pairs"][address] = self._pair(address, route.dst_rank, verify=True)
            self._send(t, pair, messages)
        used.add(address)

    def _parts(self, t: Outgoing, seg: SegmentOut, pack, offset: int):
        """A segment's K and V as they are sent: in the pack, views of the cache, or (a
        segment too large for a pack) gathered on their own."""
        dtype, shape = seg.k_cache.dtype, seg.shape
        if offset != NOT_PACKED:
            k = typed(pack[offset:], dtype, shape)
            return k, typed(pack[offset + seg.nbytes :], dtype, shape)
        if seg.zero_copy:
            return seg.views()
        k, v = (typed(self._buffer(t, seg.nbytes), dtype, shape) for _ in range(2))
        seg.gather_into(k, v)
        return k, v

    def _send(self, t: Outgoing, pair: SendPair, messages: list, ack: torch.Tensor | None = None):
        """Post ``(tensor, tag, pack buffer or None)`` sends. Sends of one tag on a pair
        complete in order, so only packs (to reuse their buffers) and, at the end, the
        last send of each tag are waited for (once each: gloo counts completions).
        With ``ack``, also post the receive of the acknowledgement and return its work,
        under the same lock: receivers answer in the order ENDs arrive, and gloo matches
        receives of a tag in the order they were posted, so concurrent ``finish`` calls
        on one pair must post theirs in the order of their ENDs."""
        sends = t.extra.setdefault("sends", [])
        packs = t.extra.setdefault("packs", collections.deque())
        with pair.lock:
            if pair.broken is not None:
                raise KVPeerError(f"connection to KV receiver {pair.address} lost: {pair.broken}")
            if t.extra.get("aborted"):
                raise KVTransferError(f"KV transfer {t.transfer_id!r} was aborted")
            try:
                for tensor, tag, pack in messages:
                    work = pair.pg.send([tensor], 1, tag)
                    if pack is None:
                        sends.append((pair, tag, work, tensor))
                    else:
                        packs.append((pair, work, tensor, pack))
                if ack is not None:
                    return pair.pg.recv([ack], 1, wire.TAG_ACK)
            except Exception as e:  # noqa: BLE001
                raise self._broken(pair, e) from e
        return None

    def _take_pack(self, t: Outgoing, nbytes: int) -> torch.Tensor:
        """A pooled buffer for a pack. With ``pack_window`` packs of this transfer still on
        their way, waits for the oldest to be sent and reuses its buffer (memory stays
        bounded, and recently written: the copy and the transport share the caches)."""
        while len(t.extra.setdefault("packs", collections.deque())) >= self.pack_window:
            self._pack_sent(t, self.connect_timeout)
        return self.pool.take(nbytes)

    def _pack_sent(self, t: Outgoing, wait_for: datetime.timedelta) -> None:
        try:
            pair, work, tensor, pack = t.extra["packs"].popleft()
        except (KeyError, IndexError):  # aborted meanwhile: the drain has them
            return
        self._wait(pair, work, wait_for, t)
        self.group.settle(tensor)
        self.pool.give(pack)

    def _all_sent(self, t: Outgoing, wait_for: datetime.timedelta) -> None:
        """Wait until every send of the transfer is done. A send's work stays referenced
        until then: gloo drops the message of a send whose work is destroyed early."""
        while t.extra.get("packs"):
            self._pack_sent(t, wait_for)
        sends = t.extra.setdefault("sends", [])
        last = {(pair, tag): i for i, (pair, tag, _, _) in enumerate(sends)}
        for i in sorted(last.values()):
            self._wait(sends[i][0], sends[i][2], wait_for, t)
        sends.clear()

    def _abort(self, t: Outgoing) -> None:
        """What was posted still goes (the receiver drops it); its works are waited for in
        the background, since gloo drops the message of a destroyed work and the pair's
        receives would be left out of step. Nothing more of the transfer is posted."""
        t.extra["aborted"] = True
        for pair in list(t.extra.get("pairs", {}).values()):
            with pair.lock:  # a _send in progress ends first; later ones see "aborted"
                pass
        sends, packs = t.extra.pop("sends", []), t.extra.pop("packs", collections.deque())
        if sends or packs:
            threading.Thread(target=self._drain, args=(sends, packs), daemon=True).start()

    def _drain(self, sends: list, packs: collections.deque) -> None:
        try:
            while packs:
                pair, work, _, pack = packs.popleft()
                work.wait(self.connect_timeout)
                self.pool.give(pack)
            last = {(pair, tag): i for i, (pair, tag, _, _) in enumerate(sends)}
            for i in sorted(last.values()):
                sends[i][2].wait(self.connect_timeout)
        except Exception:  # noqa: BLE001 - the pair broke: nothing more will be sent
            return

    def _buffer(self, t: Outgoing, nbytes: int) -> torch.Tensor:
        buf = self.pool.take(nbytes)
        t.buffers.append(buf)  # back to the pool at the end of the transfer
        return buf

    def _finish(self, t: Outgoing, timeout: float | None) -> list[Ack]:
        wait_for = datetime.timedelta(seconds=timeout) if timeout else FOREVER
        pending = []
        for address, pair in t.extra.get("pairs", {}).items():
            h = wire.header(Kind.END, t.key, self.layout.tp_rank, t.segments.get(address, 0))
            end = torch.tensor(h, dtype=torch.int64, device=self.device_type)
            ack = torch.empty(wire.HDR_LEN, dtype=torch.int64, device=self.device_type)
            work = self._send(t, pair, [(end, wire.TAG_HDR, None)], ack=ack)
            pending.append((pair, work, ack))
        self._all_sent(t, wait_for)
        acks = []
        for pair, work, ack in pending:
            self._wait(pair, work, wait_for, t)
            self.group.sync()
            h = ack.tolist()
            if (h[wire.H_MAGIC], h[wire.H_KIND], h[wire.H_KEY]) != (wire.MAGIC, Kind.ACK, t.key):
                raise self._broken(pair, RuntimeError(f"unexpected acknowledgement {h[:4]}"))
            pair.acked_at = time.monotonic()
            acks.append(Ack(pair.address, Status(h[wire.H_STATUS]), wire.ack_text(h)))
        return acks

    def _wait(self, pair: SendPair, work, wait_for, t: Outgoing) -> None:
        try:
            work.wait(wait_for)
        except Exception as e:  # noqa: BLE001
            err = self._broken(pair, e)
            if "Timed out" in str(e) or "timeout" in str(e).lower():
                raise KVTransferTimeout(
                    f"KV transfer {t.transfer_id!r} to {pair.address}: no acknowledgement "
                    f"in time ({e})"
                ) from e
            raise err from e

    def close(self) -> None:
        with self._pairs_lock:
            pairs, self._pairs = list(self._pairs.values()), {}
        for pair in pairs:
            if pair.broken is None:
                h = wire.header(Kind.BYE, 0, self.layout.tp_rank)
                bye = torch.tensor(h, dtype=torch.int64, device=self.device_type)
                with contextlib.suppress(Exception), pair.lock:  # closing anyway
                    pair.pg.send([bye], 1, wire.TAG_HDR).wait(self.connect_timeout)
            abort(pair.pg)


class NcclSender(GlooSender):
    """Prefill side over NCCL point-to-point: the same protocol on CUDA tensors."""

    backend = "nccl"
    group = NcclGroup
