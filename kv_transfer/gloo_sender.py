"""Prefill side of the ``gloo`` and ``nccl`` backends: one two-rank group per decode rank,
formed on first contact through the receiver's store (this side is rank 0), and batches
of segments sent as a header, then the batch's pack and its direct messages (one per
part of a segment: K and V, or a latent cache's row).

A pair is rebuilt when it broke, and, on a transfer's first use of a pair idle for
``verify_idle_s``, when the receiver behind the address restarted (its card in the store
names another incarnation). A restarted receiver on a recently used pair is found by the
transfer's first send failing: nothing of the transfer went there yet, so it joins the
new receiver and sends again.

The receiver's store is reached through its authenticated rendezvous
(``rendezvous/server.py``): the receiver proves the cluster's secret before its card is
read or a join is pushed, so nothing without it can pose as the receiver. A join
carries a proof of the secret for the incarnation on the receiver's card
(``kv_transfer/auth.py``) and a new generation each time; this side's pair device
listens on ``bind`` only.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import threading
import time
import uuid
from dataclasses import dataclass, field

import torch
from torch.distributed import PrefixStore

from pdserve.kv_transfer import auth
from pdserve.kv_transfer import gloo_wire as wire
from pdserve.kv_transfer import kv_transfer_pb2 as pb
from pdserve.kv_transfer.gloo_wire import NOT_PACKED, GlooGroup, Kind, NcclGroup, abort
from pdserve.kv_transfer.layout import KVLayout, KVLayoutError
from pdserve.kv_transfer.protocol import KVPeerError, KVTransferError, KVTransferTimeout, Status
from pdserve.kv_transfer.segment import Source, typed
from pdserve.kv_transfer.sender import Ack, KVSender, Outgoing
from pdserve.rendezvous.client import RendezvousStore

CONNECT_S = 5.0  # the most a connection to a receiver's rendezvous may take, handshake and all


class SendPair:
    """A two-rank group with the receiver at ``address``."""

    def __init__(self, address: str, pg, card: pb.ReceiverCard, store, pack_bytes: int):
        self.address, self.pg, self.card, self.store = address, pg, card, store
        self.pack_bytes = min(pack_bytes, card.pack_bytes or pack_bytes)
        self.lock = threading.Lock()
        self.broken: Exception | None = None
        self.acked_at = time.monotonic()  # when the receiver last answered (or joined)

    def alive(self) -> bool:
        """Whether the receiver it was formed with still serves the address (one store
        round trip)."""
        try:
            with self.lock:
                card = pb.ReceiverCard.FromString(self.store.get("kv/receiver"))
        except Exception:  # noqa: BLE001 - unreachable: gone
            return False
        return card.incarnation == self.card.incarnation


@dataclass(eq=False)
class GlooOutgoing(Outgoing):
    pairs: dict[str, SendPair] = field(default_factory=dict)  # the pair per address
    sends: list = field(default_factory=list)  # (pair, tag, work, tensor) until done
    packs: collections.deque = field(default_factory=collections.deque)  # (pair, work, buf)
    acks: dict[str, list] = field(default_factory=dict)  # address -> [(pair, work, tensor)]
    used: set[str] = field(default_factory=set)  # addresses something was posted to
    aborted: bool = False


class GlooSender(KVSender[GlooOutgoing]):
    """Prefill side over torch.distributed point-to-point (gloo on CPU)."""

    backend = "gloo"
    group = GlooGroup
    outgoing = GlooOutgoing

    def __init__(
        self,
        layout: KVLayout,
        *,
        connect_timeout=30.0,
        pack_below=128 << 10,
        pack_bytes=4 << 20,
        pack_window=4,
        verify_idle_s=1.0,
        batch_bytes: int | None = None,
        **kwargs,
    ):
        self.device_type = self.group.device_type
        super().__init__(layout, **kwargs)
        self.pack_below = pack_below  # K (or V) parts under this are packed, not sent alone
        self.pack_bytes = pack_bytes  # most bytes in one pack (the receiver may ask for less)
        self.pack_window = max(1, pack_window)  # packs of a transfer on their way at once
        self.verify_idle_s = verify_idle_s
        # data under one header (None: as much as fits); 4 MiB with checksums by default,
        # since the sums are taken before the header goes and checked once the batch landed
        self.batch_bytes = 4 << 20 if batch_bytes is None and self.checksum else batch_bytes
        self.connect_timeout = datetime.timedelta(seconds=connect_timeout)
        self._pairs: dict[str, SendPair] = {}
        self._pairs_lock = threading.Lock()

    # -- pairs -------------------------------------------------------------------------
    def _pair(self, address: str, dst_rank: int) -> SendPair:
        with self._pairs_lock:
            pair = self._pairs.get(address)
            fresh = pair is not None and time.monotonic() - pair.acked_at < self.verify_idle_s
            if pair is not None and pair.broken is None and (fresh or pair.alive()):
                return pair
            if pair is not None:
                self._pairs.pop(address)
                abort(pair.pg)
            pair = self._pairs[address] = self._connect(address, dst_rank)
            return pair

    def _connect(self, address: str, dst_rank: int) -> SendPair:
        """Join the receiver at ``address``: read its card, push a join, form the group."""
        try:
            store = self._store(address)
            card = pb.ReceiverCard.FromString(store.get("kv/receiver"))
        except Exception as e:  # noqa: BLE001 - any failure to reach it means the same
            raise KVPeerError(f"cannot reach KV receiver {address}: {e}") from e
        theirs = KVLayout.from_proto(card.layout)
        self.layout.check_compatible(theirs)
        if theirs.tp_rank != dst_rank:
            raise KVLayoutError(
                f"KV receiver {address} is decode rank {theirs.tp_rank}, but "
                f"the destination lists it as rank {dst_rank}"
            )
        if card.backend != self.backend:
            raise KVPeerError(f"KV receiver {address} runs {card.backend!r}, not {self.backend!r}")
        join = pb.Join(name=self.name, rank=self.layout.tp_rank, gen=uuid.uuid4().hex)
        self.layout.to_proto(join.layout)
        join.proof = auth.join_proof(
            self.secret,
            card.incarnation,
            join.name,
            join.rank,
            join.gen,
            join.layout.SerializeToString(deterministic=True),
        )
        prefix = f"pair/{join.name}/{join.rank}/{join.gen}"
        try:  # the receiver may die between its card and the join: the same peer failure
            store.queue_push("kv/joins", join.SerializeToString())
            form = min(self.connect_timeout, wire.PAIR_FORM)
            pg = self.group.make_group(PrefixStore(prefix, store), 0, self.advertise, form)
        except Exception as e:  # noqa: BLE001
            raise KVPeerError(f"cannot form a group with KV receiver {address}: {e}") from e
        return SendPair(address, pg, card, store, self.pack_bytes)

    def _store(self, address: str) -> RendezvousStore:
        """A client of the receiver's rendezvous, both sides proved: a dead receiver
        refuses the connection at once, a silent one or one without the secret fails
        within ``CONNECT_S``."""
        host, port = wire.split_address(address)
        seconds = min(CONNECT_S, self.connect_timeout.total_seconds())
        return RendezvousStore(host, port, self.secret, self.connect_timeout, seconds)

    def _transfer_pair(self, t: GlooOutgoing, address: str, dst_rank: int) -> SendPair:
        if address not in t.pairs:
            t.pairs[address] = self._pair(address, dst_rank)
        return t.pairs[address]

    def _disconnect(self, address: str) -> None:
        """Say BYE (the receiver's pair thread ends at once: gloo's abort() does not close
        the connection while this process lives) and drop the pair."""
        with self._pairs_lock:
            pair = self._pairs.pop(address, None)
        if pair is None:
            return
        if pair.broken is None:
            bye = wire.header(Kind.BYE, 0, self.layout.tp_rank)
            with contextlib.suppress(Exception), pair.lock:  # leaving anyway
                hdr = torch.tensor(bye, dtype=torch.int64, device=self.device_type)
                pair.pg.send([hdr], 1, wire.TAG_HDR).wait(self.connect_timeout)
        pair.broken = KVPeerError("disconnected")
        abort(pair.pg)

    def _broken(self, pair: SendPair, error: Exception) -> KVPeerError:
        pair.broken = error
        abort(pair.pg)
        return KVPeerError(f"connection to KV receiver {pair.address} lost: {error}")

    # -- data --------------------------------------------------------------------------
    def _part_limit(self, t, address, route) -> int:
        return min(self.part_bytes, self._transfer_pair(t, address, route.dst_rank).pack_bytes // 2)

    def _post(self, t: GlooOutgoing, route, address: str, source: Source, segments) -> None:
        pair = self._transfer_pair(t, address, route.dst_rank)
        per, parts = self.layout.block_bytes(1), self.layout.parts
        for batch in wire.plan_batches(
            segments, source, per, pair.pack_bytes, self.pack_below, self.batch_bytes, parts
        ):
            self._post_batch(t, route, address, source, batch)

    def _post_batch(self, t: GlooOutgoing, route, address, source: Source, batch) -> None:
        """Gather the batch's pack, then send its header, the pack and the direct parts.
        gloo's own thread writes them once the receiver has posted its receives, so the
        next pack is gathered while this one travels."""
        h = wire.header(Kind.DATA, t.key, self.layout.tp_rank, batch.pack_bytes)
        pack = self._take_pack(t, batch.pack_bytes) if batch.pack_bytes else None
        if pack is not None:
            wire.fill_pack(pack, batch, source, self.layout.torch_dtype, self.layout.parts)
        direct: list[torch.Tensor] = []
        for i, (seg, nbytes, offset) in enumerate(batch.rows):
            total = None
            if offset == NOT_PACKED or self.checksum:
                parts = self._parts(t, source, seg, pack, offset, nbytes)
                total = self._sum(t, seg, *parts) if self.checksum else None
                direct += list(parts) if offset == NOT_PACKED else []
            wire.put_row(h, i, seg, total, offset)
        hdr = torch.tensor(h, dtype=torch.int64, device=self.device_type)
        messages: list[tuple[torch.Tensor, int, torch.Tensor | None]] = [(hdr, wire.TAG_HDR, None)]
        if pack is not None:
            messages.append((pack[: batch.pack_bytes], wire.TAG_PACK, pack))
        messages += [(part, wire.TAG_DATA, None) for part in direct]
        pair = t.pairs[address]
        try:
            self._send(t, pair, messages)
        except KVPeerError:
            if address in t.used:
                raise
            # nothing of this transfer went there yet: the receiver restarted since the
            # pair last answered (not asked then, see _pair); join it again and resend
            t.sends = [s for s in t.sends if s[0] is not pair]
            t.packs = collections.deque(p for p in t.packs if p[0] is not pair)
            t.pairs[address] = self._pair(address, route.dst_rank)
            self._send(t, t.pairs[address], messages)
        t.used.add(address)

    def _parts(self, t, source: Source, seg, pack, offset: int, nbytes: int):
        """A segment's parts (K and V, or the latent row) as sent: in the pack, views of
        the cache, or (too large for a pack) gathered on their own."""
        dtype, shape, parts = self.layout.torch_dtype, source.shape(seg), self.layout.parts
        if offset != NOT_PACKED:
            return tuple(typed(pack[offset + p * nbytes :], dtype, shape) for p in range(parts))
        if (views := source.views(seg)) is not None:
            return views
        out = tuple(typed(self._buffer(t, nbytes), dtype, shape) for _ in range(parts))
        source.gather(seg, out)
        return out

    def _end(self, t: GlooOutgoing, address: str, handoff: bytes) -> None:
        pair = t.pairs[address]
        end = wire.header(Kind.END, t.key, self.layout.tp_rank, len(handoff))
        messages = [
            (torch.tensor(end, dtype=torch.int64, device=self.device_type), wire.TAG_HDR, None)
        ]
        if handoff:
            raw = torch.frombuffer(bytearray(handoff), dtype=torch.uint8).to(self.device_type)
            messages.append((raw, wire.TAG_END, None))
        ack = torch.empty(wire.HDR_LEN, dtype=torch.int64, device=self.device_type)
        work = self._send(t, pair, messages, ack=ack)
        t.acks.setdefault(address, []).append((pair, work, ack))

    def _send(self, t: GlooOutgoing, pair: SendPair, messages: list, ack=None):
        """Post ``(tensor, tag, pack buffer or None)`` sends; sends of one tag on a pair
        complete in order, so only packs (to reuse their buffers) and, at the end, the
        last send of each tag are waited for. With ``ack``, also post the receive of the
        answer, under the same lock: receivers answer in the order ENDs arrive, and gloo
        matches receives of a tag in the order they were posted."""
        with pair.lock:
            if pair.broken is not None:
                raise KVPeerError(f"connection to KV receiver {pair.address} lost: {pair.broken}")
            if t.aborted:
                raise KVTransferError(f"KV transfer {t.transfer_id!r} was aborted")
            try:
                for tensor, tag, pack in messages:
                    work = pair.pg.send([tensor], 1, tag)
                    if pack is None:
                        t.sends.append((pair, tag, work, tensor))
                    else:
                        t.packs.append((pair, work, pack))
                if ack is not None:
                    return pair.pg.recv([ack], 1, wire.TAG_ACK)
            except Exception as e:  # noqa: BLE001
                raise self._broken(pair, e) from e
        return None

    def _take_pack(self, t: GlooOutgoing, nbytes: int) -> torch.Tensor:
        """A pooled buffer; with ``pack_window`` packs of the transfer still on their way,
        first waits for the oldest (memory stays bounded, and recently written)."""
        while len(t.packs) >= self.pack_window:
            self._pack_sent(t, self.connect_timeout)
        return self.pool.take(nbytes)

    def _pack_sent(self, t: GlooOutgoing, wait_for) -> None:
        pair, work, pack = t.packs.popleft()
        self._wait(pair, work, wait_for, t)
        self.group.sync(pack)
        self.pool.give(pack)

    def _buffer(self, t: Outgoing, nbytes: int) -> torch.Tensor:
        buf = self.pool.take(nbytes)
        t.buffers.append(buf)  # back to the pool at the end of the transfer
        return buf

    def _all_sent(self, t: GlooOutgoing, wait_for: datetime.timedelta) -> None:
        """Wait for every send of the transfer. A send's work stays referenced until
        then: gloo drops the message of a send whose work is destroyed early. Sends of
        one tag on a pair complete in order, so the last of each is waited for."""
        while t.packs:
            self._pack_sent(t, wait_for)
        last = {(pair, tag): i for i, (pair, tag, _, _) in enumerate(t.sends)}
        for i in sorted(last.values()):
            self._wait(t.sends[i][0], t.sends[i][2], wait_for, t)
        t.sends.clear()

    def _acks(self, t: GlooOutgoing, timeout: float) -> list[Ack]:
        """Every send, then each END's answer, within ``timeout`` in all."""
        deadline = time.monotonic() + timeout
        self._all_sent(t, datetime.timedelta(seconds=timeout))
        out = []
        for address in t.segments:
            if address not in t.acks:
                raise KVTransferError(f"KV transfer {t.transfer_id!r}: no END went to {address}")
            for pair, work, ack in t.acks[address]:
                left = max(0.001, deadline - time.monotonic())
                self._wait(pair, work, datetime.timedelta(seconds=left), t)
                self.group.sync(ack)
                h = ack.tolist()
                if h[wire.H_MAGIC] != wire.MAGIC or (h[wire.H_KIND], h[wire.H_KEY]) != (
                    Kind.ACK,
                    t.key,
                ):
                    raise self._broken(pair, RuntimeError(f"unexpected acknowledgement {h[:4]}"))
                pair.acked_at = time.monotonic()
            out.append(Ack(address, Status(h[wire.H_STATUS]), wire.ack_text(h)))
        return out

    def _wait(self, pair: SendPair, work, wait_for, t: Outgoing) -> None:
        try:
            work.wait(wait_for)
        except Exception as e:  # noqa: BLE001
            err = self._broken(pair, e)
            if "timed out" in str(e).lower() or "timeout" in str(e).lower():
                raise KVTransferTimeout(
                    f"KV transfer {t.transfer_id!r} to {pair.address}: no "
                    f"acknowledgement in time ({e})"
                ) from e
            raise err from e

    def _abort(self, t: GlooOutgoing) -> None:
        """What was posted still goes (the receiver drops it); its works are waited for in
        the background, since gloo drops the message of a destroyed work and the pair's
        receives would be left out of step. Nothing more of the transfer is posted."""
        t.aborted = True
        for pair in list(t.pairs.values()):
            with pair.lock:  # a _send in progress ends first; later ones see "aborted"
                pass
        if t.sends or t.packs:
            threading.Thread(target=self._drain, args=(t,), daemon=True).start()

    def _drain(self, t: GlooOutgoing) -> None:
        with contextlib.suppress(KVTransferError):  # the pair broke: nothing more will go
            self._all_sent(t, self.connect_timeout)

    def close(self) -> None:
        for address in list(self._pairs):
            self._disconnect(address)


class NcclSender(GlooSender):
    """Prefill side over NCCL point-to-point: the same protocol on CUDA tensors."""

    backend = "nccl"
    group = NcclGroup
