"""The receiver's bookkeeping, shared by every backend: which transfers it expects, which
pieces have landed, and the rule that bytes land only while their transfer is expected.

A piece is (source rank, layer, K or V, block position). ``expect`` registers a transfer
with the blocks reserved for it; each arriving segment is checked against the routes
(``head_map.routes_into``) and copied into the cache; ``wait`` returns once every piece
from every source rank is in. A transfer leaves the book exactly once (``wait``
returning or raising, ``cancel``, or its lease running out in ``reap_expired``), and
after that no byte of it is written: a write in progress finishes before the transfer
is dropped, and later ones are refused. So freeing the reserved blocks right after is
safe.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np
import torch

from kv_transfer.blocks import full_heads, is_run, scatter
from kv_transfer.errors import KVChecksumError, KVTransferError, KVTransferTimeout
from kv_transfer.head_map import HeadRoute, routes_into
from kv_transfer.layout import KVLayout, KVLayoutError

log = logging.getLogger(__name__)


class Status(IntEnum):
    """A source's standing for one transfer, as acknowledged to it (PushAck.Status)."""

    OK = 0
    INCOMPLETE = 1
    CHECKSUM = 2
    UNKNOWN = 3
    REJECTED = 4


def transfer_key(transfer_id: str) -> int:
    """A 63-bit integer naming a transfer id (the gloo/nccl header has no strings)."""
    digest = hashlib.blake2b(transfer_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@dataclass(frozen=True)
class TransferStats:
    """A completed transfer as the receiver saw it."""

    transfer_id: str
    bytes: int
    segments: int
    seconds: float  # from the first byte to the last
    waited_s: float  # from ``expect`` to completion


def _ranges(values: Sequence[int]) -> str:
    out, i = [], 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        out.append(str(values[i]) if i == j else f"{values[i]}-{values[j]}")
        i = j + 1
    return ",".join(out)


@dataclass(eq=False)
class _Pending:
    transfer_id: str
    key: int
    dst_block_ids: tuple[int, ...]
    src_layout: KVLayout
    routes: dict[int, HeadRoute]  # by source rank
    deadline: float | None
    have: np.ndarray  # bool [source ranks (route order), layers, 2, blocks]
    rows: dict[int, int]  # source rank -> row of ``have``
    missing: int
    created: float = field(default_factory=time.monotonic)
    first_at: float | None = None
    last_at: float | None = None
    bytes: int = 0
    segments: int = 0
    inflight: int = 0
    claims: set = field(default_factory=set)
    done: bool = False
    dropped: bool = False
    error: KVTransferError | None = None

    def missing_of(self, src_rank: int) -> int:
        return int((~self.have[self.rows[src_rank]]).sum())

    def describe_missing(self) -> str:
        parts = []
        for src, row in self.rows.items():
            complete = self.have[row].reshape(self.have.shape[1], -1).all(axis=1)
            layers = [int(layer) for layer in np.flatnonzero(~complete)]
            if layers:
                parts.append(f"layers {_ranges(layers)} from source rank {src}")
        return "; ".join(parts) or "nothing"


@dataclass(eq=False)
class Claim:
    """One segment being written into the cache (see ``TransferBook.claim``)."""

    pending: _Pending
    src_rank: int
    layer: int
    kv: int
    start: int
    count: int
    route: HeadRoute
    on_stuck: Callable[[], None] | None = None


class TransferBook:
    """Expected transfers of one decode rank, and the writes into its cache."""

    def __init__(
        self,
        layout: KVLayout,
        kv_cache: torch.Tensor,
        recent: int = 4096,
        stuck_s: float = 5.0,
    ):
        layout.check_cache(kv_cache)
        self.layout, self.kv_cache = layout, kv_cache
        self.num_blocks = kv_cache.shape[2]
        self._cond = threading.Condition()
        self._by_id: dict[str, _Pending] = {}
        self._by_key: dict[int, _Pending] = {}
        self._recent: OrderedDict[int, tuple[Status, str]] = OrderedDict()
        self._recent_max = recent
        self.stuck_s = stuck_s  # how long dropping a transfer waits for a write in progress

    # -- control plane ---------------------------------------------------------------
    def expect(
        self,
        transfer_id: str,
        dst_block_ids: Sequence[int],
        src_layout: KVLayout,
        lease_s: float | None = None,
    ) -> None:
        src_layout.check_compatible(self.layout)
        ids = tuple(int(b) for b in dst_block_ids)
        bad = [b for b in ids if not 0 <= b < self.num_blocks]
        if bad:
            raise KVLayoutError(
                f"transfer {transfer_id!r}: destination blocks {bad[:5]} are outside the "
                f"cache's {self.num_blocks} blocks"
            )
        if len(set(ids)) != len(ids):
            raise KVLayoutError(f"transfer {transfer_id!r}: destination blocks repeat: {ids}")
        routes = {r.src_rank: r for r in routes_into(self.layout, src_layout.tp_size)}
        rows = {src: i for i, src in enumerate(sorted(routes))}
        have = np.zeros((len(rows), self.layout.num_layers, 2, len(ids)), dtype=bool)
        key = transfer_key(transfer_id)
        with self._cond:
            if transfer_id in self._by_id:
                raise KVTransferError(f"transfer {transfer_id!r} is already expected")
            if key in self._by_key:  # a 63-bit hash collision: refuse rather than mix bytes
                raise KVTransferError(f"transfer {transfer_id!r} collides with a pending one")
            p = _Pending(
                transfer_id=transfer_id,
                key=key,
                dst_block_ids=ids,
                src_layout=src_layout,
                routes=routes,
                deadline=None if lease_s is None else time.monotonic() + lease_s,
                have=have,
                rows=rows,
                missing=have.size,
            )
            p.done = p.missing == 0
            self._by_id[transfer_id] = p
            self._by_key[key] = p
            self._recent.pop(key, None)

    def wait(self, transfer_id: str, timeout: float | None = None) -> TransferStats:
        """Block until the transfer is complete; it leaves the book either way.

        ``timeout`` defaults to what is left of the lease (forever without one). Raises
        ``KVTransferTimeout`` naming the missing layers and source ranks,
        ``KVChecksumError`` on a corrupted chunk, ``KVTransferError`` for an unknown id.
        """
        with self._cond:
            p = self._by_id.get(transfer_id)
            if p is None:
                raise KVTransferError(
                    f"transfer {transfer_id!r} is not expected here (never expected, "
                    "already waited for, cancelled or expired)"
                )
            now = time.monotonic()
            deadline = p.deadline if timeout is None else now + timeout
            while not p.done and p.error is None:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                self._cond.wait(remaining)
            self._drop(p)
            if p.error is not None:
                raise p.error
            if not p.done:
                got = p.have.size - p.missing
                raise KVTransferTimeout(
                    f"KV transfer {transfer_id!r} timed out after "
                    f"{time.monotonic() - p.created:.1f}s with {got}/{p.have.size} pieces "
                    f"received; missing {p.describe_missing()}. The reservation is released."
                )
            return self._stats(p)

    def ready(self, transfer_id: str) -> bool:
        """True once the transfer is complete or failed (``wait`` then returns at once)."""
        with self._cond:
            p = self._by_id.get(transfer_id)
            return p is None or p.done or p.error is not None

    def cancel(self, transfer_id: str) -> bool:
        """Drop an expected transfer; returns whether it was there. No byte of it lands after."""
        with self._cond:
            p = self._by_id.get(transfer_id)
            if p is None:
                return False
            self._drop(p)
            return True

    def reap_expired(self) -> list[str]:
        """Drop the transfers whose lease ran out without a ``wait``; their ids."""
        now = time.monotonic()
        with self._cond:
            gone = [
                p
                for p in self._by_id.values()
                if p.deadline is not None and now >= p.deadline and not p.done
            ]
            for p in gone:
                self._drop(p)
        return [p.transfer_id for p in gone]

    def pending(self) -> list[str]:
        with self._cond:
            return list(self._by_id)

    # -- data plane ------------------------------------------------------------------
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
            p = self._by_key.get(key)
            if p is None:
                return None, Status.UNKNOWN, "transfer not expected (never, or no longer)"
            if p.error is not None:
                return None, Status(self._status_of(p.error)), str(p.error)
            problem = self._check(p, src_rank, src_layout, layer, kv, start, count, heads, shape)
            if problem:
                p.error = KVTransferError(f"transfer {p.transfer_id!r} rejected: {problem}")
                self._cond.notify_all()
                return None, Status.REJECTED, problem
            c = Claim(p, src_rank, layer, kv, start, count, p.routes[src_rank], on_stuck)
            p.inflight += 1
            p.claims.add(c)
            return c, Status.OK, ""

    def target(self, c: Claim) -> torch.Tensor | None:
        """The cache region a claimed segment fills, when it is one contiguous tensor
        (consecutive destination blocks, all of this rank's heads): receive into it."""
        ids = c.pending.dst_block_ids[c.start : c.start + c.count]
        cache = self.kv_cache[c.layer, c.kv]
        if is_run(ids) and full_heads(cache, c.route.dst_heads):
            return cache[ids[0] : ids[0] + c.count]
        return None

    def write(self, c: Claim, data: torch.Tensor) -> None:
        """Copy a claimed segment into its blocks (indexed copy when they are scattered)."""
        ids = c.pending.dst_block_ids[c.start : c.start + c.count]
        scatter(self.kv_cache[c.layer, c.kv], ids, c.route.dst_heads, data)

    def commit(self, c: Claim, nbytes: int, ok: bool) -> None:
        """End a claim: when ``ok``, its blocks count as landed."""
        p = c.pending
        with self._cond:
            p.inflight -= 1
            p.claims.discard(c)
            if ok and not p.dropped:
                now = time.monotonic()
                p.first_at = p.first_at or now
                p.last_at = now
                p.bytes += nbytes
                p.segments += 1
                cells = p.have[p.rows[c.src_rank], c.layer, c.kv, c.start : c.start + c.count]
                p.missing -= int(c.count - cells.sum())
                cells[:] = True
                p.done = p.missing == 0
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
            shape: tuple[int, ...] = ()  # refused by _check
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
            self.commit(c, data.numel() * data.element_size(), ok)
        return Status.OK, ""

    def fail(self, key: int, error: KVTransferError) -> None:
        """Mark a transfer failed (a checksum mismatch, say); ``wait`` raises ``error``."""
        with self._cond:
            p = self._by_key.get(key)
            if p is not None and p.error is None:
                p.error = error
                self._cond.notify_all()

    def transfer_id_of(self, key: int) -> str | None:
        with self._cond:
            p = self._by_key.get(key)
            return None if p is None else p.transfer_id

    def source_status(self, key: int, src_rank: int) -> tuple[Status, str]:
        """How a source's share of a transfer stands (what its acknowledgement says)."""
        with self._cond:
            p = self._by_key.get(key)
            if p is None:
                if key in self._recent:
                    return self._recent[key]
                return Status.UNKNOWN, "transfer not expected (never, or no longer)"
            if p.error is not None:
                return Status(self._status_of(p.error)), str(p.error)
            if src_rank not in p.rows:
                return Status.REJECTED, f"source rank {src_rank} has no heads for this rank"
            missing = p.missing_of(src_rank)
            if missing:
                return Status.INCOMPLETE, f"{missing} pieces missing: {p.describe_missing()}"
            return Status.OK, ""

    # -- internals -------------------------------------------------------------------
    @staticmethod
    def _status_of(error: KVTransferError) -> Status:
        if isinstance(error, KVChecksumError):
            return Status.CHECKSUM
        if isinstance(error, KVTransferTimeout):
            return Status.UNKNOWN
        return Status.REJECTED

    def _check(self, p, src_rank, src_layout, layer, kv, start, count, heads, shape) -> str:
        try:
            src_layout.check_compatible(self.layout)
        except KVLayoutError as e:
            return str(e)
        route = p.routes.get(src_rank)
        if src_layout.tp_size != p.src_layout.tp_size:
            return (
                f"sender has tensor_parallel={src_layout.tp_size}, the transfer was "
                f"expected from tensor_parallel={p.src_layout.tp_size}"
            )
        if route is None:
            return f"source rank {src_rank} holds no heads of this decode rank"
        if tuple(heads) != route.heads:
            return f"source rank {src_rank} sent heads {tuple(heads)}, expected {route.heads}"
        if not 0 <= layer < self.layout.num_layers or kv not in (0, 1):
            return f"layer {layer} / kv {kv} is outside the cache"
        n = len(p.dst_block_ids)
        if start < 0 or count < 1 or start + count > n:
            return f"blocks [{start}, {start + count}) are outside the transfer's {n} blocks"
        want = (count, self.layout.block_size, route.num_heads, self.layout.head_dim)
        if tuple(shape) != want:
            return f"segment shape {tuple(shape)}, expected {want} of {self.layout.dtype}"
        return ""

    def _drop(self, p: _Pending) -> None:
        """Unregister ``p`` (lock held) once no write into its blocks is in progress."""
        if p.dropped:
            return
        p.dropped = True
        self._by_id.pop(p.transfer_id, None)
        self._by_key.pop(p.key, None)
        for phase in ("wait", "break"):
            deadline = time.monotonic() + self.stuck_s
            while p.inflight and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            if not p.inflight:
                break
            if phase == "wait":  # a write hangs (a stalled sender): break its connection
                for c in list(p.claims):
                    if c.on_stuck is not None:
                        c.on_stuck()
        if p.inflight:
            log.error("transfer %r dropped with %d writes still pending", p.transfer_id, p.inflight)
        if p.error is not None:
            status = (self._status_of(p.error), str(p.error))
        elif p.done:
            status = (Status.OK, "")
        else:
            status = (Status.UNKNOWN, "transfer dropped before it completed")
        self._recent[p.key] = status
        while len(self._recent) > self._recent_max:
            self._recent.popitem(last=False)

    def _stats(self, p: _Pending) -> TransferStats:
        first, last = p.first_at or p.created, p.last_at or p.created
        return TransferStats(p.transfer_id, p.bytes, p.segments, last - first, last - p.created)
