"""One expected transfer as the receiver's book holds it, the claim on one segment being
written, and the statuses and stats that come out of them."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from kv_transfer.errors import KVChecksumError, KVTransferError, KVTransferTimeout
from kv_transfer.head_map import HeadRoute
from kv_transfer.layout import KVLayout, KVLayoutError


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


def status_of(error: KVTransferError) -> Status:
    """What a failed transfer acknowledges to its sources."""
    if isinstance(error, KVChecksumError):
        return Status.CHECKSUM
    if isinstance(error, KVTransferTimeout):
        return Status.UNKNOWN
    return Status.REJECTED


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
class Pending:
    """An expected transfer: its blocks, routes, lease and which pieces have landed."""

    transfer_id: str
    key: int
    dst_block_ids: tuple[int, ...]
    src_layout: KVLayout
    routes: dict[int, HeadRoute]  # by source rank
    deadline: float | None
    have: np.ndarray  # bool [source ranks (route order), layers, 2, blocks]
    rows: dict[int, int]  # source rank -> row of ``have``
    missing: int
    run_ends: list[int] = field(default_factory=list)  # per position: where its id run ends
    checked_layout: KVLayout | None = None  # the last source layout found compatible
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

    @classmethod
    def new(
        cls,
        transfer_id: str,
        dst_block_ids: tuple[int, ...],
        src_layout: KVLayout,
        routes: Sequence[HeadRoute],
        num_layers: int,
        lease_s: float | None,
    ) -> Pending:
        by_src = {r.src_rank: r for r in routes}
        rows = {src: i for i, src in enumerate(sorted(by_src))}
        have = np.zeros((len(rows), num_layers, 2, len(dst_block_ids)), dtype=bool)
        run_ends, end = [0] * len(dst_block_ids), len(dst_block_ids)
        for i in range(len(dst_block_ids) - 1, -1, -1):
            if i + 1 < len(dst_block_ids) and dst_block_ids[i + 1] != dst_block_ids[i] + 1:
                end = i + 1
            run_ends[i] = end
        return cls(
            transfer_id=transfer_id,
            key=transfer_key(transfer_id),
            dst_block_ids=dst_block_ids,
            src_layout=src_layout,
            routes=by_src,
            deadline=None if lease_s is None else time.monotonic() + lease_s,
            have=have,
            rows=rows,
            missing=have.size,
            run_ends=run_ends,
            done=have.size == 0,
        )

    def land(self, claims: Sequence[Claim]) -> None:
        """Mark the claims' blocks as landed; claims of one source rank and block range
        are marked with one indexed update."""
        now = time.monotonic()
        self.first_at = self.first_at or now
        self.last_at = now
        per_head = self.src_layout.block_bytes(1)  # bytes of one block, per KV head
        self.bytes += per_head * sum(c.count * c.route.num_heads for c in claims)
        self.segments += len(claims)
        groups: dict[tuple[int, int, int], set[tuple[int, int]]] = {}
        for c in claims:
            groups.setdefault((c.src_rank, c.start, c.count), set()).add((c.layer, c.kv))
        for (src_rank, start, count), pieces in groups.items():
            layers, kvs = zip(*pieces, strict=True)
            cells = self.have[self.rows[src_rank], :, :, start : start + count]
            self.missing -= int(count * len(pieces) - cells[list(layers), list(kvs)].sum())
            cells[list(layers), list(kvs)] = True
        self.done = self.missing == 0

    def stats(self) -> TransferStats:
        first, last = self.first_at or self.created, self.last_at or self.created
        return TransferStats(
            self.transfer_id, self.bytes, self.segments, last - first, last - self.created
        )

    def is_run(self, start: int, count: int) -> bool:
        """Whether destination positions ``[start, start + count)`` are consecutive ids."""
        return self.run_ends[start] >= start + count

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

    def check_segment(
        self,
        layout: KVLayout,
        src_rank: int,
        src_layout: KVLayout,
        layer: int,
        kv: int,
        start: int,
        count: int,
        heads: tuple[int, int],
        shape: tuple[int, ...],
        same_layout: bool = False,
    ) -> str:
        """Why a segment does not belong in this transfer of a rank with ``layout``
        ("" when it does). ``same_layout``: ``src_layout`` was found compatible before."""
        if not same_layout:
            try:
                src_layout.check_compatible(layout)
            except KVLayoutError as e:
                return str(e)
        route = self.routes.get(src_rank)
        if src_layout.tp_size != self.src_layout.tp_size:
            return (
                f"sender has tensor_parallel={src_layout.tp_size}, the transfer was "
                f"expected from tensor_parallel={self.src_layout.tp_size}"
            )
        if route is None:
            return f"source rank {src_rank} holds no heads of this decode rank"
        if tuple(heads) != route.heads:
            return f"source rank {src_rank} sent heads {tuple(heads)}, expected {route.heads}"
        if not 0 <= layer < layout.num_layers or kv not in (0, 1):
            return f"layer {layer} / kv {kv} is outside the cache"
        n = len(self.dst_block_ids)
        if start < 0 or count < 1 or start + count > n:
            return f"blocks [{start}, {start + count}) are outside the transfer's {n} blocks"
        want = (count, layout.block_size, route.num_heads, layout.head_dim)
        if tuple(shape) != want:
            return f"segment shape {tuple(shape)}, expected {want} of {layout.dtype}"
        return ""


@dataclass(eq=False)
class Claim:
    """One segment being written into the cache (see ``TransferBook.claim``)."""

    pending: Pending
    src_rank: int
    layer: int
    kv: int
    start: int
    count: int
    route: HeadRoute
    on_stuck: Callable[[], None] | None = None
