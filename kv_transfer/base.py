"""The KV transfer interface every backend implements, and the registry that picks one.

Contract
--------
Prefill side, one ``KVSender`` per tensor-parallel rank (its ``KVLayout``):

* ``send_layer(transfer_id, layer, k_cache, v_cache, src_block_ids, dst)`` sends this
  rank's share of one layer of a request: for every decode rank whose heads intersect
  this rank's (``head_map.routes_from``), the blocks ``src_block_ids`` of
  ``k_cache``/``v_cache`` (this layer's ``[blocks, block_size, local heads, head_dim]``
  views, ``ModelRunner.kv_caches[layer]``), restricted to those heads. It returns once
  the data is handed to the transport (packed or referenced), not when it has arrived,
  so it can be called from the forward pass right after the layer is computed
  (layer-wise). Layers go in any order, each exactly once per transfer. ``block_offset``
  places ``src_block_ids`` at that position of the request's block list, for callers
  that send a request's blocks in parts.
* ``finish(transfer_id, timeout)`` waits until every byte sent for the transfer has been
  received and acknowledged by every decode rank it went to; returns a ``TransferAck``,
  raises a ``KVTransferError`` (``KVChecksumError``, ``KVPeerError``,
  ``KVTransferTimeout``) otherwise. Until it returns, the source blocks must not be
  overwritten (a backend may send straight from the cache).
* ``abort(transfer_id)`` forgets a transfer without waiting (the receiver's lease cleans up).

Decode side, one ``KVReceiver`` per tensor-parallel rank, owning its cache tensor:

* ``address``: where senders reach it (``host:port``); the decode instance publishes it
  in the ``KVDestination`` of its reservations.
* ``expect(transfer_id, dst_block_ids, src_layout, lease_s)`` before the transfer can
  arrive (at reservation time): the i-th source block lands in ``dst_block_ids[i]``,
  heads placed by ``head_map.routes_into``. Bytes of transfers not expected are dropped.
* ``wait(transfer_id, timeout)`` returns ``TransferStats`` when every layer from every
  source rank has landed; raises ``KVTransferTimeout`` (naming what is missing) or
  ``KVChecksumError``. The transfer leaves the receiver either way (also through
  ``cancel`` and ``reap_expired``), and no byte of it is written afterwards, so the
  caller may free or reuse the blocks at once.

Groups are formed per (sender, receiver) pair when they first talk, never as one world
frozen at launch: a restarted or new worker on either side just connects.
"""

from __future__ import annotations

import importlib
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kv_transfer.blocks import BufferPool, full_heads, gather, plan_segments
from kv_transfer.book import Status, TransferBook, TransferStats, transfer_key
from kv_transfer.errors import KVChecksumError, KVTransferError
from kv_transfer.handoff import KVDestination
from kv_transfer.head_map import HeadRoute, routes_from
from kv_transfer.layout import KVLayout, KVLayoutError


@dataclass(frozen=True)
class Ack:
    """One decode rank's answer for one transfer."""

    address: str
    status: Status
    message: str = ""


@dataclass(frozen=True)
class TransferAck:
    """A finished transfer as the sender saw it."""

    transfer_id: str
    bytes: int
    segments: int
    seconds: float  # from the first send_layer to the last acknowledgement
    acks: tuple[Ack, ...]


@dataclass(frozen=True)
class SegmentOut:
    """One segment to send: positions ``[start, start + count)`` of the request's block
    list (source blocks ``ids``), one layer, the source heads ``heads`` (local)."""

    layer: int
    start: int
    count: int
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    ids: list[int]
    heads: tuple[int, int]
    contiguous: bool  # consecutive source ids

    @property
    def shape(self) -> tuple[int, ...]:
        bs, _, d = self.k_cache.shape[1:]
        return (self.count, bs, self.heads[1] - self.heads[0], d)

    @property
    def nbytes(self) -> int:
        """Bytes of K (and of V)."""
        n = self.k_cache.element_size()
        for s in self.shape:
            n *= s
        return n

    @property
    def zero_copy(self) -> bool:
        """K and V are each one contiguous region of the cache (``views``)."""
        return self.contiguous and full_heads(self.k_cache, self.heads)

    def views(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as views of the cache (``zero_copy`` segments only)."""
        b0 = self.ids[0]
        return self.k_cache[b0 : b0 + self.count], self.v_cache[b0 : b0 + self.count]

    def gather_into(self, k_out: torch.Tensor, v_out: torch.Tensor) -> None:
        """Copy K and V into ``k_out``/``v_out`` (``shape``, contiguous)."""
        gather(self.k_cache, self.ids, self.heads, k_out)
        gather(self.v_cache, self.ids, self.heads, v_out)

    def pieces(self, cache: torch.Tensor) -> list[torch.Tensor] | None:
        """K (or V) as contiguous views whose bytes, one after the other, are the
        segment's: one per run of consecutive ids. None when heads are partial."""
        if not full_heads(cache, self.heads):
            return None
        out, i, ids = [], 0, self.ids
        while i < len(ids):
            j = i + 1
            while j < len(ids) and ids[j] == ids[j - 1] + 1:
                j += 1
            out.append(cache[ids[i] : ids[i] + j - i])
            i = j
        return out


@dataclass(eq=False)
class Outgoing:
    """Sender-side state of one transfer (backends add their own fields)."""

    transfer_id: str
    key: int
    dst: KVDestination
    started: float = field(default_factory=time.monotonic)
    bytes: int = 0
    segments: dict[str, int] = field(default_factory=dict)  # per destination address
    layers: set[int] = field(default_factory=set)
    buffers: list[torch.Tensor] = field(default_factory=list)  # pooled, returned at the end
    extra: dict = field(default_factory=dict)


def check_acks(transfer_id: str, acks: Sequence[Ack]) -> None:
    for ack in acks:
        if ack.status == Status.OK:
            continue
        text = (
            f"KV transfer {transfer_id!r} to {ack.address}: receiver answered "
            f"{ack.status.name}" + (f" ({ack.message})" if ack.message else "")
        )
        raise KVChecksumError(text) if ack.status == Status.CHECKSUM else KVTransferError(text)


class KVSender(ABC):
    """Prefill side of one tensor-parallel rank. See the module docstring for the contract."""

    backend = ""
    device_type = "cpu"

    def __init__(
        self,
        layout: KVLayout,
        *,
        checksum: bool = False,
        name: str | None = None,
        part_bytes: int = 4 << 20,
        min_run: int = 4,
    ):
        self.layout = layout
        self.checksum = checksum
        self.name = name or f"sender-{uuid.uuid4().hex[:8]}"
        self.part_bytes = part_bytes  # most bytes of K (or of V) in one segment
        self.min_run = min_run
        self.pool = BufferPool(self.device_type or "cpu")
        self._lock = threading.Lock()
        self._transfers: dict[str, Outgoing] = {}
        self._corrupt_next = 0

    # -- public ------------------------------------------------------------------------
    def send_layer(
        self,
        transfer_id: str,
        layer: int,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        src_block_ids: Sequence[int],
        dst: KVDestination,
        block_offset: int = 0,
    ) -> int:
        """Send this rank's share of ``layer`` of a transfer; returns the bytes handed over."""
        return self.send_layers(
            transfer_id, [(layer, k_cache, v_cache)], src_block_ids, dst, block_offset
        )

    def send_all(
        self,
        transfer_id: str,
        kv_cache: torch.Tensor,
        src_block_ids: Sequence[int],
        dst: KVDestination,
    ) -> int:
        """Every layer of ``kv_cache`` (this rank's ``[layers, 2, ...]`` cache) at once (not
        layer-wise): backends batch the layers' metadata into fewer messages."""
        layers = [(i, kv_cache[i, 0], kv_cache[i, 1]) for i in range(self.layout.num_layers)]
        return self.send_layers(transfer_id, layers, src_block_ids, dst)

    def send_layers(
        self,
        transfer_id: str,
        layers: Sequence[tuple[int, torch.Tensor, torch.Tensor]],
        src_block_ids: Sequence[int],
        dst: KVDestination,
        block_offset: int = 0,
    ) -> int:
        """``send_layer`` for several ``(layer, k_cache, v_cache)`` at once."""
        t = self._outgoing(transfer_id, dst)
        ids = [int(b) for b in src_block_ids]
        for layer, k_cache, v_cache in layers:
            self._check_send(t, layer, k_cache, v_cache, ids, block_offset)
        sent = 0
        for route in routes_from(self.layout, dst.tp_size):
            address = dst.addresses[route.dst_rank]
            per_block = self.layout.block_bytes(route.num_heads)
            max_blocks = max(1, self._part_limit(address, route.dst_rank) // per_block)
            plan = plan_segments(ids, max_blocks, self.min_run, block_offset)
            out: list[SegmentOut] = []
            for layer, k_cache, v_cache in layers:
                for seg in plan:
                    seg_ids = ids[seg.start - block_offset : seg.start - block_offset + seg.count]
                    out.append(
                        SegmentOut(
                            layer, seg.start, seg.count, k_cache, v_cache, seg_ids,
                            route.src_heads, seg.contiguous,
                        )
                    )  # fmt: skip
                    sent += 2 * seg.count * per_block
            self._post_segments(t, route, address, out)
            t.segments[address] = t.segments.get(address, 0) + len(out)
        t.bytes += sent
        t.layers.update(layer for layer, _, _ in layers)
        return sent

    def finish(self, transfer_id: str, timeout: float | None = 60.0) -> TransferAck:
        """Wait for every destination rank to acknowledge the transfer; see the contract."""
        with self._lock:
            t = self._transfers.pop(transfer_id, None)
        if t is None:
            raise KVTransferError(f"finish({transfer_id!r}): nothing was sent for this transfer")
        try:
            acks = self._finish(t, timeout)
        finally:
            for buf in t.buffers:
                self.pool.give(buf)
            t.buffers.clear()
        check_acks(transfer_id, acks)
        return TransferAck(
            transfer_id,
            t.bytes,
            sum(t.segments.values()),
            time.monotonic() - t.started,
            tuple(acks),
        )

    def abort(self, transfer_id: str) -> None:
        """Forget a transfer: what was posted may still go; the receiver drops it when its
        lease ends. The source blocks may be reused once the backend released them."""
        with self._lock:
            t = self._transfers.pop(transfer_id, None)
        if t is not None:
            self._abort(t)

    def debug_corrupt_next_segment(self, count: int = 1) -> None:
        """Testing aid: flip one bit in the next ``count`` segments after their checksum
        was taken, so a receiver must report a mismatch."""
        self._corrupt_next = count

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- backends ----------------------------------------------------------------------
    @abstractmethod
    def _post_segments(
        self, t: Outgoing, route: HeadRoute, address: str, segments: list[SegmentOut]
    ) -> None:
        """Hand segments (contiguous K and V parts) for one destination rank to the
        transport. The parts stay valid until the transfer finishes (pooled buffers or
        views of the cache)."""

    @abstractmethod
    def _finish(self, t: Outgoing, timeout: float | None) -> list[Ack]: ...

    def _part_limit(self, address: str, dst_rank: int) -> int:
        """Most bytes of K (or V) per segment to this destination."""
        return self.part_bytes

    def _abort(self, t: Outgoing) -> None:  # noqa: B027 - optional hook
        """Default: nothing to cancel; buffers are dropped (not pooled: still in use)."""

    # -- internals ---------------------------------------------------------------------
    def _outgoing(self, transfer_id: str, dst: KVDestination) -> Outgoing:
        with self._lock:
            t = self._transfers.get(transfer_id)
            if t is None:
                self.layout.check_compatible(dst.layout)
                t = Outgoing(transfer_id, transfer_key(transfer_id), dst)
                self._transfers[transfer_id] = t
            elif t.dst is not dst and t.dst != dst:
                raise KVTransferError(
                    f"transfer {transfer_id!r} is already going to {t.dst.addresses}; "
                    "use a new transfer id for another destination"
                )
            return t

    def _check_send(self, t, layer, k_cache, v_cache, ids, block_offset) -> None:
        lay = self.layout
        if not 0 <= layer < lay.num_layers:
            raise KVLayoutError(f"layer={layer} is outside the model's {lay.num_layers} layers")
        if layer in t.layers and block_offset == 0:
            raise KVTransferError(f"transfer {t.transfer_id!r}: layer {layer} sent twice")
        want = (lay.block_size, lay.heads_per_rank, lay.head_dim)
        for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
            if c.dim() != 4 or tuple(c.shape[1:]) != want or c.dtype != lay.torch_dtype:
                raise KVLayoutError(
                    f"{name} is {tuple(c.shape)} {c.dtype}; this rank's layer cache is "
                    f"[blocks, {want[0]}, {want[1]}, {want[2]}] {lay.dtype}"
                )
            if not c.is_contiguous():
                raise KVLayoutError(f"{name} must be contiguous (a layer view of the cache)")
            if self.device_type is not None and c.device.type != self.device_type:
                raise KVLayoutError(
                    f"{name} is on {c.device}; the {self.backend} backend sends "
                    f"{self.device_type} tensors"
                )
        if not ids:
            raise KVTransferError(f"transfer {t.transfer_id!r}: no source blocks")
        if block_offset < 0 or block_offset + len(ids) > len(t.dst.block_ids):
            raise KVLayoutError(
                f"transfer {t.transfer_id!r}: blocks [{block_offset}, "
                f"{block_offset + len(ids)}) but only {len(t.dst.block_ids)} are reserved"
            )
        bad = [b for b in ids if not 0 <= b < k_cache.shape[0]]
        if bad:
            raise KVLayoutError(f"source blocks {bad[:5]} outside the cache's {k_cache.shape[0]}")

    def _take_corruption(self) -> bool:
        """Whether the segment being posted is to be corrupted (after its checksum)."""
        if self._corrupt_next <= 0:
            return False
        self._corrupt_next -= 1
        return True


class KVReceiver(ABC):
    """Decode side of one tensor-parallel rank. See the module docstring for the contract."""

    backend = ""

    def __init__(self, layout: KVLayout, kv_cache: torch.Tensor):
        self.layout = layout
        self.book = TransferBook(layout, kv_cache)

    @property
    @abstractmethod
    def address(self) -> str: ...

    def expect(
        self,
        transfer_id: str,
        dst_block_ids: Sequence[int],
        src_layout: KVLayout,
        lease_s: float | None = None,
    ) -> None:
        """Register a transfer before it can arrive: its blocks ``dst_block_ids`` (in the
        order of the source's block list) and the source pool's layout."""
        self.book.expect(transfer_id, dst_block_ids, src_layout, lease_s)

    def wait(self, transfer_id: str, timeout: float | None = None) -> TransferStats:
        return self.book.wait(transfer_id, timeout)

    def ready(self, transfer_id: str) -> bool:
        return self.book.ready(transfer_id)

    def cancel(self, transfer_id: str) -> bool:
        return self.book.cancel(transfer_id)

    def reap_expired(self) -> list[str]:
        return self.book.reap_expired()

    def pending(self) -> list[str]:
        return self.book.pending()

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@dataclass(frozen=True)
class Transport:
    """A backend: its sender and receiver classes."""

    name: str
    sender: type[KVSender]
    receiver: type[KVReceiver]


_BACKENDS = {
    "gloo": ("kv_transfer.gloo", "GlooSender", "GlooReceiver"),
    "nccl": ("kv_transfer.gloo", "NcclSender", "NcclReceiver"),
    "grpc": ("kv_transfer.grpc_transport", "GrpcSender", "GrpcReceiver"),
}
BACKENDS = tuple(_BACKENDS)


def get_transport(name: str) -> Transport:
    """The backend named by ``kv_transfer.backend``: ``gloo``, ``nccl`` or ``grpc``."""
    if name not in _BACKENDS:
        raise ValueError(f"kv_transfer.backend={name!r} is not one of {list(_BACKENDS)}")
    module, sender, receiver = _BACKENDS[name]
    mod = importlib.import_module(module)
    return Transport(name, getattr(mod, sender), getattr(mod, receiver))
