"""Decode side of the ``gloo`` and ``nccl`` backends: an authenticated rendezvous (on
``bind`` only, ``rendezvous/server.py``) that senders join through, one pair per sender
rank (replaced when that sender joins again), each read by a pair thread and a
completer thread. Only a peer that proved the cluster's secret, and was proved to, reads
the card or a pair's addresses or pushes a join; this side uses the store in process.

A join is taken only with a valid proof of the cluster's secret for this receiver's
incarnation (``kv_transfer/auth.py``), seen for the first time; anything else is
refused on the accept thread at once (no group is formed, no pair is touched) and
logged with the name it claimed.

The pair thread reads headers in order and posts each batch's receives as soon as its
header arrives (its pack into staging, its direct segments straight into the cache where
they fit); the completer finishes batches in the same order (checksums, copies out of
staging, commits, the answer to an END), so data keeps flowing while earlier batches are
copied. gloo matches messages per tag, so ``slots`` header receives are posted ahead;
NCCL matches in order whatever the tag, so there the next header receive follows the
batch's.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import queue
import threading
import time
import uuid

import torch
from torch.distributed import PrefixStore, QueueEmptyError

from pdserve.kv_transfer import auth
from pdserve.kv_transfer import gloo_wire as wire
from pdserve.kv_transfer import kv_transfer_pb2 as pb
from pdserve.kv_transfer.gloo_wire import FOREVER, NOT_PACKED, GlooGroup, Kind, NcclGroup, abort
from pdserve.kv_transfer.layout import KVLayout, KVLayoutError
from pdserve.kv_transfer.receiver import Claim, KVReceiver
from pdserve.kv_transfer.segment import BufferPool, typed
from pdserve.rendezvous.server import RendezvousServer

log = logging.getLogger(__name__)
POLL_S = 0.02  # how often the accept thread looks for joins (and for close())
MAX_JOIN = 4096  # most bytes of a join taken off the queue


class RecvPair:
    """A two-rank group with one sender rank (this side is rank 1): the book's link."""

    def __init__(self, join: pb.Join, pg):
        self.key, self.gen = (join.name, join.rank), join.gen
        self.sender = join.name  # proved by the join (``KVReceiver.claim`` checks it)
        self.layout = KVLayout.from_proto(join.layout)
        self.pg = pg
        self.replaced = False
        self.waiting = None  # a receive posted on this pair (there always is one)

    def break_(self) -> None:
        """Close the connection, failing every receive posted on it, so no byte lands in
        their buffers afterwards. gloo's abort() does not wake a posted receive while the
        peer lives; a receive timing out closes the pair, so a 1 ms wait on one does."""
        if self.waiting is not None:
            with contextlib.suppress(Exception):
                self.waiting.wait(datetime.timedelta(milliseconds=1))


class GlooReceiver(KVReceiver):
    """Decode side over torch.distributed point-to-point (gloo on CPU)."""

    backend = "gloo"
    group = GlooGroup

    def __init__(
        self,
        layout: KVLayout,
        kv_cache: torch.Tensor,
        *,
        port=0,
        connect_timeout=30.0,
        slots=4,
        pack_bytes=4 << 20,
        **kwargs,
    ):
        if kv_cache.device.type != self.group.device_type:
            raise KVLayoutError(
                f"the {self.backend} backend needs a {self.group.device_type} "
                f"cache, got {kv_cache.device}"
            )
        super().__init__(layout, kv_cache, **kwargs)
        self.slots, self.pack_bytes = slots, pack_bytes
        self.pool = BufferPool(kv_cache.device)
        self.connect_timeout = datetime.timedelta(seconds=connect_timeout)
        self._rendezvous = RendezvousServer(self.bind, port, self.secret)
        self._store = self._rendezvous.store
        self.incarnation = uuid.uuid4().hex
        card = pb.ReceiverCard(
            backend=self.backend, incarnation=self.incarnation, pack_bytes=pack_bytes
        )
        layout.to_proto(card.layout)
        self._store.set("kv/receiver", card.SerializeToString())
        self._address = self._address_of(self._rendezvous.port)
        self._seen = auth.Seen()
        self._bad_joins = 0  # joins refused so far
        self._pairs: dict[tuple[str, int], RecvPair] = {}
        self._pairs_lock = threading.Lock()
        self.generations: dict[tuple[str, int], int] = {}  # joins seen per sender rank
        self._threads: list[threading.Thread] = []
        self._accept = self._thread(self._accept_loop, "accept")

    @property
    def address(self) -> str:
        return self._address

    @property
    def refused(self) -> int:
        """Joins refused, and connections to the rendezvous that did not prove the secret."""
        return self._bad_joins + self._rendezvous.refused

    def _thread(self, target, name: str, *args) -> threading.Thread:
        t = threading.Thread(
            target=target, args=args, name=f"kv-{self.backend}-{name}", daemon=True
        )
        t.start()
        return t

    def _accept_loop(self) -> None:
        # Only this thread touches the store after __init__, for the join queue and for
        # forming every pair (in process: peers reach it through the rendezvous). It polls
        # the queue without blocking (a blocking pop that times out logs warnings).
        store = self._store
        store.set_timeout(self.connect_timeout)
        while not self._closed:
            try:
                raw = store.queue_pop("kv/joins", False)
            except QueueEmptyError:
                time.sleep(POLL_S)
                continue
            except Exception as e:  # noqa: BLE001 - the store itself failed: nothing to serve
                if not self._closed:
                    log.error("KV receiver %s: join queue failed: %s", self._address, e)
                return
            try:
                join = self._check_join(raw)
            except Exception as e:  # noqa: BLE001 - a bad join must not stop the loop
                self._bad_joins += 1
                log.warning(
                    "KV receiver %s: join refused (%d so far): %s",
                    self._address,
                    self._bad_joins,
                    e,
                )
                continue
            try:
                prefix = f"pair/{join.name}/{join.rank}/{join.gen}"
                form = min(self.connect_timeout, wire.PAIR_FORM)
                pg = self.group.make_group(PrefixStore(prefix, store), 1, self.advertise, form)
            except Exception as e:  # noqa: BLE001 - the sender went away meanwhile
                log.warning(
                    "KV receiver %s: pair with %s rank %d not formed: %s",
                    self._address,
                    join.name[:64],
                    join.rank,
                    e,
                )
                continue
            pair = RecvPair(join, pg)
            with self._pairs_lock:
                old, self._pairs[pair.key] = self._pairs.get(pair.key), pair
                self.generations[pair.key] = self.generations.get(pair.key, 0) + 1
            if old is not None:  # the sender restarted: its old group is dead or dying
                old.replaced = True
                old.break_()
            self._threads.append(self._thread(self._serve, f"pair-{join.name}-{join.rank}", pair))

    def _check_join(self, raw: bytes) -> pb.Join:
        """The join in ``raw`` when it proves the secret for this incarnation, for the
        first time, with a layout that fits; else a ValueError saying why."""
        if len(raw) > MAX_JOIN:
            raise ValueError(f"a join of {len(raw)} bytes; allowed: up to {MAX_JOIN}")
        join = pb.Join.FromString(raw)
        who = f"{join.name[:64]!r} rank {join.rank}"
        layout = join.layout.SerializeToString(deterministic=True)
        proof = auth.join_proof(
            self.secret, self.incarnation, join.name, join.rank, join.gen, layout
        )
        if not auth.valid(proof, join.proof):
            raise ValueError(f"join from {who} does not prove the cluster's secret")
        if not self._seen.first(proof):
            raise ValueError(f"join from {who} replays generation {join.gen[:32]!r}")
        KVLayout.from_proto(join.layout).check_compatible(self.layout)
        return join

    def _serve(self, pair: RecvPair) -> None:
        done: queue.SimpleQueue = queue.SimpleQueue()
        completer = self._thread(self._complete, f"done-{pair.key[0]}-{pair.key[1]}", pair, done)
        pg, tagged, dev = pair.pg, self.group.tagged, self.group.device_type
        headers = []
        for _ in range(self.slots if tagged else 1):
            hdr = torch.empty(wire.HDR_LEN, dtype=torch.int64, device=dev)
            headers.append((pg.recv([hdr], 0, wire.TAG_HDR), hdr))
        why = "closed by the sender"
        try:
            while True:
                work, hdr = headers.pop(0)
                pair.waiting = work
                work.wait(FOREVER)
                h = hdr.tolist()
                if tagged:
                    headers.append((pg.recv([hdr], 0, wire.TAG_HDR), hdr))
                if h[wire.H_MAGIC] != wire.MAGIC:
                    raise RuntimeError(f"bad header magic {h[wire.H_MAGIC]:#x}")
                if h[wire.H_KIND] == Kind.DATA:
                    done.put(self._post_batch(pair, h))
                elif h[wire.H_KIND] == Kind.END:
                    done.put((h, self._post_handoff(pair, h)))
                elif h[wire.H_KIND] == Kind.BYE:
                    return
                else:
                    raise RuntimeError(f"unknown header kind {h[wire.H_KIND]}")
                if not tagged:
                    headers.append((pg.recv([hdr], 0, wire.TAG_HDR), hdr))
        except Exception as e:  # noqa: BLE001 - the connection broke, or a bad header
            why = str(e)
            if not (self._closed or pair.replaced):
                log.info("KV receiver %s: pair %s closed: %s", self._address, pair.key, e)
        finally:
            done.put(None)
            completer.join()
            self.link_lost(pair, pair.key[1], why)
            with self._pairs_lock:
                if self._pairs.get(pair.key) is pair:
                    del self._pairs[pair.key]
            abort(pg)

    def _post_batch(self, pair: RecvPair, h: list[int]):
        """Check a DATA header, post its pack's receive, then claim the direct segments and
        post their K and V receives, in the order the sender sends them."""
        lay = self.layout
        rows = wire.rows(h, lay.num_layers, self.num_blocks, lay.units)
        size, per, parts = h[wire.H_AUX], lay.block_bytes(1), lay.parts
        for seg, _, offset in rows:  # rows() bounded each segment's blocks and heads
            if (
                offset != NOT_PACKED
                and not 0 <= offset <= size - parts * seg.count * seg.num_heads * per
            ):
                raise RuntimeError(f"segment at {offset} outside a pack of {size} bytes")
        if not 0 <= size <= self.pack_bytes:
            raise RuntimeError(f"a pack of {size} bytes exceeds {self.pack_bytes}")
        pack = None
        if size:
            staging = self.pool.take(size)
            pack = (pair.pg.recv([staging[:size]], 0, wire.TAG_PACK), staging)
        direct = [(seg, total) for seg, total, offset in rows if offset == NOT_PACKED]
        items = []
        if direct:
            claims, _, _ = self.claim(
                h[wire.H_KEY],
                h[wire.H_SRC_RANK],
                pair.layout,
                [s for s, _ in direct],
                pair,
                pair.break_,
            )
            for i, (seg, total) in enumerate(direct):
                claim = claims[i] if claims else None
                targets = None if claim is None else self.targets(claim)
                buf = None
                if targets is None:  # scattered blocks, or nowhere to go: into staging
                    n = seg.count * seg.num_heads * per
                    buf = self.pool.take(parts * n)
                    shape = (seg.count, lay.block_size, seg.num_heads, lay.unit_dim)
                    targets = tuple(
                        typed(buf[p * n :], lay.torch_dtype, shape) for p in range(parts)
                    )
                works = [pair.pg.recv([x], 0, wire.TAG_DATA) for x in targets]
                items.append((claim, total, targets, buf, works))
        return h, rows, pack, items

    def _post_handoff(self, pair: RecvPair, h: list[int]):
        n = h[wire.H_AUX]
        if not 0 <= n <= wire.MAX_HANDOFF:
            raise RuntimeError(f"an END announces {n} bytes of handoff")
        if not n:
            return None
        raw = torch.empty(n, dtype=torch.uint8, device=self.group.device_type)
        return pair.pg.recv([raw], 0, wire.TAG_END), raw

    def _complete(self, pair: RecvPair, done: queue.SimpleQueue) -> None:
        broken = False
        while (item := done.get()) is not None:
            if len(item) == 4:
                h, rows, pack, items = item
                broken = self._complete_batch(pair, h, rows, pack, items, broken)
                continue
            h, handoff = item
            if broken or (handoff is not None and not self._waited(handoff[0])):
                broken = True
                continue
            raw = b"" if handoff is None else handoff[1].cpu().numpy().tobytes()
            status, text = self.end(h[wire.H_KEY], h[wire.H_SRC_RANK], raw, pair)
            answer = wire.ack(h[wire.H_KEY], h[wire.H_SRC_RANK], int(status), text)
            try:
                ack = torch.tensor(answer, device=self.group.device_type)
                pair.pg.send([ack], 0, wire.TAG_ACK).wait(self.connect_timeout)
            except Exception:  # noqa: BLE001 - the pair is gone
                broken = True

    def _complete_batch(self, pair, h, rows, pack, items, broken: bool) -> bool:
        """Land one batch: its pack, then its direct segments; whether the pair broke."""
        if pack is not None:
            broken = broken or not self._waited(pack[0])
            if not broken:
                self._land_pack(pair, h, rows, pack[1])
            self.pool.give(pack[1])
        if items:  # receives of one tag complete in order: the last one implies all
            ok = not broken and self._waited(items[-1][4][-1])
            broken = broken or not ok
            landed: list[Claim] = []
            failed: list[Claim] = []
            for claim, total, parts, buf, _ in items:
                if claim is not None:
                    good = ok and (total is None or self.verify(claim, total, *parts))
                    if good and buf is not None:
                        self.write(claim, *parts)
                    (landed if good else failed).append(claim)
                if buf is not None:
                    self.pool.give(buf)
            if landed:
                self.group.sync()
            self.commit(landed, True)
            self.commit(failed, False)
        return broken

    def _land_pack(self, pair: RecvPair, h, rows, buf: torch.Tensor) -> None:
        """Claim, check and copy the packed segments; consecutive layers at one position
        are claimed together and copied with one (indexed) copy."""
        lay = self.layout
        per, dtype, parts = lay.block_bytes(1), lay.torch_dtype, lay.parts
        packed = [
            (seg, off, seg.count * seg.num_heads * per, total)
            for seg, total, off in rows
            if off != NOT_PACKED
        ]
        for i, j in wire.layer_spans([p[:3] for p in packed], parts):
            segs = [p[0] for p in packed[i:j]]
            claims, _, _ = self.claim(h[wire.H_KEY], h[wire.H_SRC_RANK], pair.layout, segs, pair)
            if not claims:
                continue  # not expected (any more): dropped
            shape = (segs[0].count, lay.block_size, segs[0].num_heads, lay.unit_dim)
            data = typed(buf[packed[i][1] :], dtype, (j - i, parts, *shape))
            sums = [p[3] for p in packed[i:j]]
            ok = all(
                total is None or self.verify(c, total, *data[r].unbind(0))
                for r, (c, total) in enumerate(zip(claims, sums, strict=True))
            )
            if ok:
                self.write_layers(claims, data)
                self.group.sync()
            self.commit(claims, ok)

    def _waited(self, work) -> bool:
        try:
            work.wait(self.connect_timeout)
            return True
        except Exception:  # noqa: BLE001 - the pair is gone; the pair's thread sees it too
            return False

    def close(self) -> None:
        if self._closed:
            return
        super().close()
        with self._pairs_lock:
            pairs = list(self._pairs.values())
        for pair in pairs:
            pair.replaced = True
            pair.break_()
        self._rendezvous.close()
        self._accept.join(timeout=POLL_S + self.connect_timeout.total_seconds())
        for t in self._threads:
            t.join(timeout=5)


class NcclReceiver(GlooReceiver):
    """Decode side over NCCL point-to-point: the same protocol on CUDA tensors."""

    backend = "nccl"
    group = NcclGroup
