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

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

import torch

from kv_transfer.errors import KVTransferError, KVTransferTimeout
from kv_transfer.head_map import routes_into
from kv_transfer.landing import Landing
from kv_transfer.layout import KVLayout, KVLayoutError
from kv_transfer.pending import (
    Claim,
    Pending,
    Status,
    TransferStats,
    status_of,
)

log = logging.getLogger(__name__)


class TransferBook(Landing):
    """Expected transfers of one decode rank, and (``Landing``) the writes into its cache."""

    def __init__(
        self,
        layout: KVLayout,
        kv_cache: torch.Tensor,
        recent: int = 4096,
        stuck_s: float = 5.0,
    ):
        layout.check_cache(kv_cache)
        self.layout, self.kv_cache = layout, kv_cache
        self.layer_caches = [layer.unbind(0) for layer in kv_cache.unbind(0)]  # [layer][kv]
        self.num_blocks = kv_cache.shape[2]
        self._cond = threading.Condition()
        self._by_id: dict[str, Pending] = {}
        self._by_key: dict[int, Pending] = {}
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
        routes = routes_into(self.layout, src_layout.tp_size)
        p = Pending.new(transfer_id, ids, src_layout, routes, self.layout.num_layers, lease_s)
        with self._cond:
            if transfer_id in self._by_id:
                raise KVTransferError(f"transfer {transfer_id!r} is already expected")
            if p.key in self._by_key:  # a 63-bit hash collision: refuse rather than mix bytes
                raise KVTransferError(f"transfer {transfer_id!r} collides with a pending one")
            self._by_id[transfer_id] = p
            self._by_key[p.key] = p
            self._recent.pop(p.key, None)

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
            return p.stats()

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
                return Status(status_of(p.error)), str(p.error)
            if src_rank not in p.rows:
                return Status.REJECTED, f"source rank {src_rank} has no heads for this rank"
            missing = p.missing_of(src_rank)
            if missing:
                return Status.INCOMPLETE, f"{missing} pieces missing: {p.describe_missing()}"
            return Status.OK, ""

    # -- internals -------------------------------------------------------------------
    def _drop(self, p: Pending) -> None:
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
            status = (status_of(p.error), str(p.error))
        elif p.done:
            status = (Status.OK, "")
        else:
            status = (Status.UNKNOWN, "transfer dropped before it completed")
        self._recent[p.key] = status
        while len(self._recent) > self._recent_max:
            self._recent.popitem(last=False)


__all__ = ["Claim", "Status", "TransferBook", "TransferStats"]
