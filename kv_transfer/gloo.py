"""torch.distributed point-to-point backends: ``gloo`` (CPU tensors) and ``nccl`` (CUDA).

Groups: no cluster-wide world. Each receiver (decode rank) runs a ``TCPStore`` server;
its address ``host:port`` is what senders are given. A sender that first talks to a
receiver connects to that store, reads the receiver's layout, pushes a join request
``{name, rank, gen, layout}`` onto the store's ``kv/joins`` queue and builds a two-rank
group on ``PrefixStore("pair/<name>/<rank>/<gen>", store)`` (sender rank 0, receiver
rank 1); the receiver's accept thread pops the request and builds its side. A restarted
sender joins again under a new ``gen``, which replaces the receiver's old pair; a sender
whose receiver died finds the pair broken and joins afresh on its next send.

Wire protocol on a pair (no pickle; metadata travels as int64 header tensors):

* sender -> receiver, per ``send_layer(s)`` call and destination rank: a ``DATA`` header
  (tag 1) holding a table of up to 32 segments (layer, block positions, head range,
  byte count, checksum, pack id and offset), then the segments' bytes (tag 2) in table
  order: K and V as two messages sent straight from the cache for a run of consecutive
  blocks holding all of the rank's heads (at least ``pack_below`` bytes), otherwise
  gathered with their neighbours into one packed message;
* sender -> receiver, per transfer: an ``END`` header with the segment count;
* receiver -> sender: an ``ACK`` header (tag 3) with the status, then a 256-byte UTF-8
  message (tag 4);
* sender -> receiver on close: a ``BYE`` header.

The receiver posts a segment's receives as soon as its header arrives, straight into
the cache when the destination blocks are consecutive and hold all of its heads, into
a staging buffer otherwise; a second thread completes them in order (checksum, copy
out of staging, bookkeeping), so data keeps flowing while earlier segments are copied.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import json
import logging
import os
import queue
import threading
import time
import uuid
from dataclasses import asdict
from enum import IntEnum

import torch
from torch.distributed import PrefixStore, QueueEmptyError, TCPStore

from kv_transfer.base import Ack, KVReceiver, KVSender, Outgoing, SegmentOut
from kv_transfer.blocks import BufferPool, typed
from kv_transfer.book import Status
from kv_transfer.checksum import checksum, combine
from kv_transfer.errors import KVChecksumError, KVPeerError, KVTransferTimeout
from kv_transfer.head_map import HeadRoute
from kv_transfer.layout import KVLayout, KVLayoutError

log = logging.getLogger(__name__)

MAGIC = 0x4B5632  # "KV2"
MSG_LEN = 256
TAG_HDR, TAG_DATA, TAG_ACK, TAG_ACK_MSG = 1, 2, 3, 4
JOIN_QUEUE = "kv/joins"
INFO_KEY = "kv/receiver"
POLL_S = 0.02  # how often the receiver's accept thread looks for joins (and close())
FOREVER = datetime.timedelta(days=365)  # an idle pair waits for its next header this long


class Kind(IntEnum):
    DATA = 1
    END = 2
    ACK = 3
    BYE = 4


# header: 8 int64 fields, then a table of up to MAX_SEGS segments of ROW fields each
H_MAGIC, H_KIND, H_KEY, H_SRC_RANK, H_NSEGS, H_STATUS, H_SEGMENTS, _H_SPARE = range(8)
S_LAYER, S_START, S_COUNT, S_HEAD0, S_HEAD1, S_NBYTES, S_HAS_SUM, S_SUM, S_PACK, S_OFFSET = range(
    10
)
ROW = 10
MAX_SEGS = 32
HDR_LEN = 8 + ROW * MAX_SEGS
NO_PACK = -1


def _signed(u: int) -> int:
    return u - (1 << 64) if u >= 1 << 63 else u


def _unsigned(s: int) -> int:
    return s & ((1 << 64) - 1)


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"KV receiver address {address!r} is not host:port")
    return host.strip("[]"), int(port)


class _Group:
    """Builds two-rank groups; the NCCL subclass swaps the group type and the device."""

    device_type = "cpu"
    tagged = True  # messages match per tag (NCCL: in order, tags ignored)

    @staticmethod
    def make_group(store, rank: int, host: str, timeout: datetime.timedelta):
        from torch.distributed import ProcessGroupGloo

        opts = ProcessGroupGloo._Options()
        opts._devices = [ProcessGroupGloo.create_device(hostname=host)]
        opts._timeout = timeout
        return ProcessGroupGloo(store, rank, 2, opts)

    @staticmethod
    def sync() -> None:
        return None


class _NcclGroup(_Group):
    device_type = "cuda"
    tagged = False

    @staticmethod
    def make_group(store, rank: int, host: str, timeout: datetime.timedelta):
        if not torch.cuda.is_available():
            raise KVPeerError("the nccl KV backend needs CUDA; use gloo or grpc on CPU")
        from torch.distributed import ProcessGroupNCCL

        opts = ProcessGroupNCCL.Options()
        opts._timeout = FOREVER  # an idle receiver keeps a header recv posted
        return ProcessGroupNCCL(store, rank, 2, opts)

    @staticmethod
    def sync() -> None:
        torch.cuda.current_stream().synchronize()


def _layout_json(layout: KVLayout) -> dict:
    return asdict(layout)


class _SendPair:
    def __init__(self, address: str, pg, info: dict, store):
        self.address, self.pg, self.info, self.store = address, pg, info, store
        self.lock = threading.Lock()
        self.broken: Exception | None = None

    def alive(self) -> bool:
        """Whether the receiver this pair was formed with still serves its address (one
        store round trip): a restarted receiver has a new incarnation, a dead one none."""
        try:
            with self.lock:
                info = json.loads(self.store.get(INFO_KEY))
        except Exception:  # noqa: BLE001 - unreachable: gone
            return False
        return info.get("incarnation") == self.info.get("incarnation")


class GlooSender(KVSender):
    """Prefill side over torch.distributed point-to-point (gloo on CPU)."""

    backend = "gloo"
    group = _Group

    def __init__(
        self,
        layout: KVLayout,
        *,
        host: str | None = None,
        connect_timeout: float = 30.0,
        pack_below: int = 256 << 10,
        pack_bytes: int = 4 << 20,
        **kwargs,
    ):
        self.device_type = self.group.device_type
        super().__init__(layout, **kwargs)
        # parts under pack_below bytes are copied into packed messages of up to pack_bytes:
        # below that size gloo's per-message cost exceeds a copy's
        self.pack_below, self.pack_bytes = pack_below, max(pack_bytes, 2 * pack_below)
        self.host = host or os.environ.get("PDSERVE_KV_HOST", "127.0.0.1")
        self.connect_timeout = datetime.timedelta(seconds=connect_timeout)
        self._pairs: dict[str, _SendPair] = {}
        self._pairs_lock = threading.Lock()

    # -- pairs -------------------------------------------------------------------------
    def _pair(self, address: str, dst_rank: int, verify: bool = False) -> _SendPair:
        """The pair with ``address``, formed on first use; rebuilt when it broke, or (with
        ``verify``, once per transfer) when the receiver behind the address restarted."""
        with self._pairs_lock:
            pair = self._pairs.get(address)
            if pair is not None and pair.broken is None:
                if not verify or pair.alive():
                    return pair
                pair.broken = KVPeerError(f"KV receiver {address} restarted")
            if pair is not None:
                self._pairs.pop(address)
                _abort(pair.pg)
            pair = self._connect(address, dst_rank)
            self._pairs[address] = pair
            return pair

    def _connect(self, address: str, dst_rank: int) -> _SendPair:
        host, port = _split(address)
        try:
            store = TCPStore(host, port, None, False, self.connect_timeout)
            info = json.loads(store.get(INFO_KEY))
        except Exception as e:  # noqa: BLE001 - any failure to reach it means the same
            raise KVPeerError(f"cannot reach KV receiver {address}: {e}") from e
        theirs = KVLayout(**info["layout"])
        self.layout.check_compatible(theirs)
        if theirs.tp_rank != dst_rank:
            raise KVLayoutError(
                f"KV receiver {address} is decode rank {theirs.tp_rank}, "
                f"but the destination lists it as rank {dst_rank}"
            )
        if info.get("backend") != self.backend:
            raise KVPeerError(
                f"KV receiver {address} runs backend {info.get('backend')!r}, not {self.backend!r}"
            )
        gen = uuid.uuid4().hex[:12]
        join = {
            "name": self.name,
            "rank": self.layout.tp_rank,
            "gen": gen,
            "host": self.host,
            "layout": _layout_json(self.layout),
        }
        store.queue_push(JOIN_QUEUE, json.dumps(join))
        prefix = f"pair/{self.name}/{self.layout.tp_rank}/{gen}"
        try:
            pg = self.group.make_group(
                PrefixStore(prefix, store), 0, self.host, self.connect_timeout
            )
        except Exception as e:  # noqa: BLE001
            raise KVPeerError(f"cannot form a group with KV receiver {address}: {e}") from e
        log.debug("kv pair %s -> %s formed (gen %s)", self.name, address, gen)
        return _SendPair(address, pg, info, store)

    def _broken(self, pair: _SendPair, error: Exception) -> KVPeerError:
        pair.broken = error
        _abort(pair.pg)
        return KVPeerError(f"connection to KV receiver {pair.address} lost: {error}")

    # -- data --------------------------------------------------------------------------
    def _header(self, kind: Kind, t: Outgoing, segments: int = 0) -> list[int]:
        h = [0] * HDR_LEN
        h[H_MAGIC], h[H_KIND], h[H_KEY] = MAGIC, int(kind), t.key
        h[H_SRC_RANK], h[H_SEGMENTS] = self.layout.tp_rank, segments
        return h

    def _post_segments(
        self, t: Outgoing, route: HeadRoute, address: str, segments: list[SegmentOut]
    ) -> None:
        """One header per MAX_SEGS segments, then their data. A segment whose K and V are
        each one region of the cache, of at least ``pack_below`` bytes, goes straight
        from the cache as two messages; the others are gathered, with their neighbours,
        into packed messages of up to ``pack_bytes`` (one copy, fewer messages)."""
        pairs = t.extra.setdefault("pairs", {})
        pair = pairs.get(address)
        if pair is None:  # first segments of this transfer to this rank: check the pair
            pair = pairs[address] = self._pair(address, route.dst_rank, verify=True)
        works = t.extra.setdefault("works", [])
        for first in range(0, len(segments), MAX_SEGS):
            batch = segments[first : first + MAX_SEGS]
            h = self._header(Kind.DATA, t)
            h[H_NSEGS] = len(batch)
            messages: list = []  # tensors, and packs [buffer, bytes used] (trimmed below)
            pack: list = []
            packs = 0
            for i, seg in enumerate(batch):
                nbytes = seg.nbytes
                pack_id, offset = NO_PACK, 0
                if seg.zero_copy and nbytes >= self.pack_below:
                    pack = []  # a pack never spans a direct segment: messages keep row order
                    k, v = seg.views()
                    messages += [k, v]
                else:
                    if not pack or pack[1] + 2 * nbytes > self.pack_bytes:
                        buf = self.pool.take(max(self.pack_bytes, 2 * nbytes))
                        t.buffers.append(buf)
                        pack = [buf, 0]
                        pack_id = packs
                        packs += 1
                        messages.append(pack)
                    pack_id, (buf, offset) = packs - 1, pack
                    k = typed(buf[offset:], seg.k_cache.dtype, seg.shape)
                    v = typed(buf[offset + nbytes :], seg.k_cache.dtype, seg.shape)
                    seg.gather_into(k, v)
                    pack[1] += 2 * nbytes
                total = combine(checksum(k), checksum(v)) if self.checksum else 0
                if self._take_corruption():  # testing aid: one bit off after the checksum
                    if pack_id == NO_PACK:
                        k = k.clone()
                        messages[-2] = k
                    k.view(-1).view(torch.uint8)[0] ^= 1
                row = 8 + ROW * i
                h[row : row + ROW] = [
                    seg.layer,
                    seg.start,
                    seg.count,
                    route.heads[0],
                    route.heads[1],
                    nbytes,
                    int(self.checksum),
                    _signed(total),
                    pack_id,
                    offset,
                ]
            hdr = torch.tensor(h, dtype=torch.int64, device=self.device_type)
            parts = [m[0][: m[1]] if isinstance(m, list) else m for m in messages]
            with pair.lock:
                if pair.broken is not None:
                    raise KVPeerError(f"connection to KV receiver {address} lost: {pair.broken}")
                try:
                    works.append((pair, pair.pg.send([hdr], 1, TAG_HDR), hdr))
                    for part in parts:
                        works.append((pair, pair.pg.send([part], 1, TAG_DATA), part))
                except Exception as e:  # noqa: BLE001
                    raise self._broken(pair, e) from e

    def _finish(self, t: Outgoing, timeout: float | None) -> list[Ack]:
        wait_for = datetime.timedelta(seconds=timeout) if timeout else FOREVER
        pending = []
        for address, pair in t.extra.get("pairs", {}).items():
            end = torch.tensor(
                self._header(Kind.END, t, t.segments.get(address, 0)),
                dtype=torch.int64,
                device=self.device_type,
            )
            ack = torch.empty(HDR_LEN, dtype=torch.int64, device=self.device_type)
            msg = torch.empty(MSG_LEN, dtype=torch.uint8, device=self.device_type)
            with pair.lock:
                if pair.broken is not None:
                    raise KVPeerError(f"connection to KV receiver {address} lost: {pair.broken}")
                try:
                    t.extra["works"].append((pair, pair.pg.send([end], 1, TAG_HDR), end))
                    w_ack = pair.pg.recv([ack], 1, TAG_ACK)
                    w_msg = pair.pg.recv([msg], 1, TAG_ACK_MSG)
                except Exception as e:  # noqa: BLE001
                    raise self._broken(pair, e) from e
            pending.append((pair, w_ack, w_msg, ack, msg))
        for pair, work, _ in t.extra.get("works", []):
            self._wait(pair, work, wait_for, t)
        acks = []
        for pair, w_ack, w_msg, ack, msg in pending:
            self._wait(pair, w_ack, wait_for, t)
            self._wait(pair, w_msg, wait_for, t)
            self.group.sync()
            h = ack.tolist()
            text = bytes(msg.cpu().tolist()).rstrip(b"\0").decode("utf-8", "replace")
            if h[H_MAGIC] != MAGIC or h[H_KIND] != Kind.ACK or h[H_KEY] != t.key:
                raise self._broken(pair, RuntimeError(f"unexpected acknowledgement {h[:4]}"))
            acks.append(Ack(pair.address, Status(h[H_STATUS]), text))
        return acks

    def _abort(self, t: Outgoing) -> None:
        """An abandoned transfer leaves its pairs' message streams mid-way (announced
        segments never sent): they are rebuilt on their next use."""
        for pair in t.extra.get("pairs", {}).values():
            with pair.lock:
                if pair.broken is None:
                    self._broken(pair, RuntimeError(f"transfer {t.transfer_id!r} aborted"))

    def _wait(self, pair: _SendPair, work, wait_for, t: Outgoing) -> None:
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
                bye = torch.zeros(HDR_LEN, dtype=torch.int64, device=self.device_type)
                bye[H_MAGIC], bye[H_KIND] = MAGIC, int(Kind.BYE)
                try:
                    with pair.lock:
                        pair.pg.send([bye], 1, TAG_HDR).wait(self.connect_timeout)
                except Exception:  # noqa: BLE001 - closing anyway
                    pass
            _abort(pair.pg)


class _RecvPair:
    def __init__(self, key: tuple[str, int], gen: str, layout: KVLayout, host: str):
        self.key, self.gen, self.layout, self.host = key, gen, layout, host
        self.pg = None
        self.replaced = False
        self.thread: threading.Thread | None = None
        self.waiting = None  # a receive posted on this pair (there always is one)

    def break_(self) -> None:
        """Close this pair's connection, failing every receive posted on it, so no byte
        lands in their buffers afterwards. gloo's abort() does not wake a posted
        receive while the peer lives; a receive timing out closes the pair, so a 1 ms
        wait on any posted receive does."""
        work = self.waiting
        if work is not None:
            with contextlib.suppress(Exception):
                work.wait(datetime.timedelta(milliseconds=1))


class GlooReceiver(KVReceiver):
    """Decode side over torch.distributed point-to-point (gloo on CPU)."""

    backend = "gloo"
    group = _Group

    def __init__(
        self,
        layout: KVLayout,
        kv_cache: torch.Tensor,
        *,
        host: str | None = None,
        port: int = 0,
        connect_timeout: float = 30.0,
        slots: int = 4,
    ):
        super().__init__(layout, kv_cache)
        self.slots = slots  # header receives each pair keeps posted ahead
        self.pool = BufferPool(kv_cache.device)
        if kv_cache.device.type != self.group.device_type:
            raise KVLayoutError(
                f"the {self.backend} backend needs a {self.group.device_type} cache, "
                f"got {kv_cache.device}"
            )
        self.host = host or os.environ.get("PDSERVE_KV_HOST", "127.0.0.1")
        self.connect_timeout = datetime.timedelta(seconds=connect_timeout)
        self._store = TCPStore(
            self.host, port, None, True, datetime.timedelta(seconds=60), wait_for_workers=False
        )
        self.incarnation = uuid.uuid4().hex[:12]
        info = {
            "layout": _layout_json(layout),
            "backend": self.backend,
            "incarnation": self.incarnation,
        }
        self._store.set(INFO_KEY, json.dumps(info))
        self._address = f"{self.host}:{self._store.port}"
        self._closed = False
        self._pairs: dict[tuple[str, int], _RecvPair] = {}
        self._pairs_lock = threading.Lock()
        self.generations: dict[tuple[str, int], int] = {}  # joins seen per sender rank
        self._accept = threading.Thread(
            target=self._accept_loop, name=f"kv-{self.backend}-accept", daemon=True
        )
        self._accept.start()

    @property
    def address(self) -> str:
        return self._address

    def pairs(self) -> dict[tuple[str, int], str]:
        """Live pairs: (sender name, sender rank) -> generation."""
        with self._pairs_lock:
            return {k: p.gen for k, p in self._pairs.items() if p.pg is not None}

    # -- pairs -------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        # After __init__ only this thread touches the store (its own connection), for the
        # join queue and for forming every pair, one at a time: torch's store client
        # sometimes needs seconds to connect (docs/kv_transfer.md), so the receiver makes
        # no new connection per pair. It polls the queue without blocking (a blocking pop
        # that times out logs warnings) every POLL_S, which also notices close().
        store = self._store
        store.set_timeout(self.connect_timeout)
        while not self._closed:
            try:
                raw = store.queue_pop(JOIN_QUEUE, False)
            except QueueEmptyError:
                time.sleep(POLL_S)
                continue
            except Exception as e:  # noqa: BLE001 - the store itself failed: nothing to serve
                if not self._closed:
                    log.error("KV receiver %s: join queue failed: %s", self._address, e)
                return
            msg = raw.decode()
            if self._closed:
                return
            try:
                join = json.loads(msg)
                theirs = KVLayout(**join["layout"])
                theirs.check_compatible(self.layout)
                pair = _RecvPair((join["name"], int(join["rank"])), join["gen"], theirs, self.host)
            except Exception as e:  # noqa: BLE001 - a bad join must not stop the loop
                log.warning("KV receiver %s: refused join %r: %s", self._address, msg[:200], e)
                continue
            prefix = f"pair/{pair.key[0]}/{pair.key[1]}/{pair.gen}"
            try:
                pg = self.group.make_group(
                    PrefixStore(prefix, store), 1, self.host, self.connect_timeout
                )
            except Exception as e:  # noqa: BLE001 - the sender went away while joining
                log.warning("KV receiver %s: pair %s not formed: %s", self._address, prefix, e)
                continue
            with self._pairs_lock:
                old = self._pairs.get(pair.key)
                pair.pg = pg
                self._pairs[pair.key] = pair
                self.generations[pair.key] = self.generations.get(pair.key, 0) + 1
            if old is not None:  # the sender restarted: its old group is dead or dying
                old.replaced = True
                old.break_()
            pair.thread = threading.Thread(
                target=self._pair_loop,
                args=(pair, prefix),
                name=f"kv-{self.backend}-pair-{pair.key[0]}-{pair.key[1]}",
                daemon=True,
            )
            pair.thread.start()

    def _pair_loop(self, pair: _RecvPair, prefix: str) -> None:
        try:
            self._serve(pair, pair.pg)
        except Exception as e:  # noqa: BLE001
            if not (self._closed or pair.replaced):
                peer_gone = "closed by peer" in str(e) or "reset by peer" in str(e)
                (log.info if peer_gone else log.warning)(
                    "KV receiver %s: pair %s closed: %s", self._address, prefix, e
                )
        finally:
            with self._pairs_lock:
                if self._pairs.get(pair.key) is pair:
                    del self._pairs[pair.key]
            _abort(pair.pg)

    def _serve(self, pair: _RecvPair, pg) -> None:
        """Read one pair's headers in order and post each segment's receives at once:
        straight into the cache when its destination blocks are one contiguous run
        holding all of this rank's heads, into a staging buffer otherwise. A second
        thread completes them in the same order (checksum, copy from staging, ACK), so
        receives are posted while earlier data is still arriving or being copied."""
        dev = self.group.device_type
        done: queue.SimpleQueue = queue.SimpleQueue()
        completer = threading.Thread(
            target=self._complete,
            args=(pair, pg, done),
            name=f"kv-{self.backend}-done-{pair.key[0]}-{pair.key[1]}",
            daemon=True,
        )
        completer.start()
        # gloo matches messages per tag, so header receives are posted ahead; NCCL matches
        # them in order whatever the tag, so its next header receive follows the data's
        ahead = self.group.tagged
        headers = collections.deque()
        for _ in range(self.slots if ahead else 1):
            hdr = torch.empty(HDR_LEN, dtype=torch.int64, device=dev)
            headers.append((pg.recv([hdr], 0, TAG_HDR), hdr))
        try:
            while True:
                work, hdr = headers.popleft()
                pair.waiting = work
                work.wait(FOREVER)
                h = hdr.tolist()
                if ahead:
                    headers.append((pg.recv([hdr], 0, TAG_HDR), hdr))
                if h[H_MAGIC] != MAGIC:
                    raise RuntimeError(f"bad header magic {h[H_MAGIC]:#x}")
                kind = h[H_KIND]
                if kind == Kind.DATA:
                    if not 0 < h[H_NSEGS] <= MAX_SEGS:
                        raise RuntimeError(f"header announces {h[H_NSEGS]} segments")
                    rows = [h[8 + ROW * i : 8 + ROW * (i + 1)] for i in range(h[H_NSEGS])]
                    # id -> [work, staging, rows left, received (None: not waited yet)]
                    packs: dict[int, list] = {}
                    for seg in rows:
                        pid = seg[S_PACK]
                        if pid != NO_PACK and pid not in packs:
                            size = max(
                                r[S_OFFSET] + 2 * r[S_NBYTES] for r in rows if r[S_PACK] == pid
                            )
                            buf = self.pool.take(size)
                            left = sum(1 for r in rows if r[S_PACK] == pid)
                            packs[pid] = [pg.recv([buf[:size]], 0, TAG_DATA), buf, left, None]
                        done.put(self._post_segment(pair, pg, h, seg, packs.get(pid)))
                elif kind in (Kind.END, Kind.BYE):
                    done.put((kind, h, None, None, None))
                    if kind == Kind.BYE:
                        return
                else:
                    raise RuntimeError(f"unknown header kind {kind}")
                if not ahead:
                    headers.append((pg.recv([hdr], 0, TAG_HDR), hdr))
        finally:
            done.put(None)
            completer.join()

    def _post_segment(self, pair: _RecvPair, pg, h: list[int], seg: list[int], pack=None):
        """Claim one announced segment and post its receives (in header order); a packed
        segment's bytes come with its pack's single receive, posted by the caller."""
        lay = self.layout
        count, heads = seg[S_COUNT], (seg[S_HEAD0], seg[S_HEAD1])
        shape = (count, lay.block_size, heads[1] - heads[0], lay.head_dim)
        nbytes = seg[S_NBYTES]
        if count < 1 or nbytes != count * lay.block_bytes(heads[1] - heads[0]):
            raise RuntimeError(f"{nbytes} bytes do not make a {shape} segment")
        items, release = [], []
        for kv in range(2):
            claim, _, _ = self.book.claim(
                h[H_KEY], h[H_SRC_RANK], pair.layout, seg[S_LAYER], kv, seg[S_START],
                count, heads, shape, on_stuck=pair.break_,
            )  # fmt: skip
            if pack is not None:
                start = seg[S_OFFSET] + kv * nbytes
                target = typed(pack[1][start : start + nbytes], lay.torch_dtype, shape)
                items.append((claim, target, True, pack))
                continue
            target = None if claim is None else self.book.target(claim)
            staged = target is None
            if staged:  # scattered blocks, or nowhere to go: receive into staging
                buf = self.pool.take(nbytes)
                release.append(buf)
                target = typed(buf, lay.torch_dtype, shape)
            items.append((claim, target, staged, pg.recv([target], 0, TAG_DATA)))
        if pack is not None:
            pack[2] -= 1
            if pack[2] == 0:  # the pack's last segment gives its staging back
                release.append(pack[1])
        return Kind.DATA, h, seg, items, release

    def _complete(self, pair: _RecvPair, pg, done: queue.SimpleQueue) -> None:
        dev = self.group.device_type
        sync = self.group.sync if dev != "cpu" else None
        broken = False
        while True:
            item = done.get()
            if item is None:
                return
            kind, h, seg, items, release = item
            if kind == Kind.DATA:
                ok = not broken
                for _, _, _, work in items:
                    if not ok:
                        break
                    pack = work if isinstance(work, list) else None
                    if pack is not None and pack[3] is not None:
                        ok = pack[3]  # a pack is waited for once (gloo counts completions)
                        continue
                    try:
                        (pack[0] if pack else work).wait(self.connect_timeout)
                    except Exception:  # noqa: BLE001 - the pair is gone; the poster sees it too
                        ok, broken = False, True
                    if pack is not None:
                        pack[3] = ok
                if ok and seg[S_HAS_SUM]:
                    got = combine(*(checksum(target) for _, target, _, _ in items))
                    if got != _unsigned(seg[S_SUM]):
                        ok = False
                        self._checksum_failed(pair, h, seg, got)
                for claim, target, staged, _ in items:
                    if claim is None:
                        continue
                    landed = ok
                    if ok and staged:
                        try:
                            self.book.write(claim, target)
                        except Exception:  # noqa: BLE001
                            landed = False
                            log.exception("KV receiver %s: copy failed", self._address)
                    if landed and sync is not None:
                        sync()
                    self.book.commit(claim, target.numel() * target.element_size(), landed)
                for buf in release:
                    self.pool.give(buf)
            elif kind == Kind.END and not broken:
                try:
                    self._ack(pg, h, dev)
                except Exception:  # noqa: BLE001 - the pair is gone
                    broken = True

    def _checksum_failed(self, pair: _RecvPair, h: list[int], seg: list[int], got: int) -> None:
        key = h[H_KEY]
        tid = self.book.transfer_id_of(key) or f"key {key:#x}"
        start = seg[S_START]
        self.book.fail(
            key,
            KVChecksumError(
                f"KV transfer {tid!r}: checksum mismatch in layer {seg[S_LAYER]}, "
                f"blocks [{start}, {start + seg[S_COUNT]}) from source rank "
                f"{h[H_SRC_RANK]} ({pair.key[0]}): sent {_unsigned(seg[S_SUM]):#018x}, "
                f"received {got:#018x}"
            ),
        )

    def _ack(self, pg, h: list[int], dev: str) -> None:
        status, text = self.book.source_status(h[H_KEY], h[H_SRC_RANK])
        ack = [0] * HDR_LEN
        ack[H_MAGIC], ack[H_KIND], ack[H_KEY], ack[H_STATUS] = (
            MAGIC,
            int(Kind.ACK),
            h[H_KEY],
            int(status),
        )
        raw = text.encode()[:MSG_LEN]
        msg = torch.zeros(MSG_LEN, dtype=torch.uint8)
        if raw:
            msg[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        pg.send([torch.tensor(ack, device=dev)], 0, TAG_ACK).wait(self.connect_timeout)
        pg.send([msg.to(dev)], 0, TAG_ACK_MSG).wait(self.connect_timeout)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._pairs_lock:
            pairs = list(self._pairs.values())
        for pair in pairs:
            pair.replaced = True
            pair.break_()
        self._accept.join(timeout=POLL_S + self.connect_timeout.total_seconds())
        for pair in pairs:
            if pair.thread is not None:
                pair.thread.join(timeout=5)


def _abort(pg) -> None:
    if pg is None:
        return
    with contextlib.suppress(Exception):  # already gone
        pg.abort()


class NcclSender(GlooSender):
    """Prefill side over NCCL point-to-point: the same protocol on CUDA tensors."""

    backend = "nccl"
    group = _NcclGroup


class NcclReceiver(GlooReceiver):
    """Decode side over NCCL point-to-point: the same protocol on CUDA tensors."""

    backend = "nccl"
    group = _NcclGroup
