"""``KVSender``: the prefill side of one tensor-parallel rank, shared by every backend:
checks, ``Segment``s per destination rank, each transfer's state (``Outgoing``, which a
backend subclasses). A backend implements the steps every transfer goes through, which
are also where a test transport injects faults: ``_post``, ``_end``, ``_acks``,
``_disconnect`` (and ``_sum``, the checksum). The contract: ``kv_transfer/__init__.py``.

Closed by default (docs/kv_transfer.md): a sender proves the cluster's ``secret`` when it
opens a link (a gloo join, a grpc stream; ``kv_transfer/auth.py``), names a transfer on
the wire by its destination's ``token`` only, and listens (gloo's pair device) on
``bind`` only.
"""

from __future__ import annotations

import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch

from pdserve.kv_transfer.auth import check_secret
from pdserve.kv_transfer.layout import KVLayout, KVLayoutError
from pdserve.kv_transfer.protocol import (
    Handoff,
    KVDestination,
    KVTransferError,
    Status,
    endpoint,
    transfer_key,
)
from pdserve.kv_transfer.routes import HeadRoute, routes_from
from pdserve.kv_transfer.segment import BufferPool, Segment, Source, checksum, plan_segments


@dataclass(frozen=True)
class Ack:
    """One decode rank's answer to this rank's END of one transfer."""

    address: str
    status: Status
    message: str = ""


@dataclass(frozen=True)
class TransferAck:
    """A finished transfer as the sender saw it."""

    transfer_id: str
    bytes: int
    segments: int
    seconds: float  # from the first send to the last acknowledgement
    acks: tuple[Ack, ...]


@dataclass(eq=False)
class Outgoing:
    """One transfer in flight from this rank (a backend adds its own fields)."""

    transfer_id: str
    key: int
    dst: KVDestination
    started: float = field(default_factory=time.monotonic)
    bytes: int = 0
    segments: dict[str, int] = field(default_factory=dict)  # per destination address
    layers: set[int] = field(default_factory=set)
    buffers: list[torch.Tensor] = field(default_factory=list)  # pooled, returned at the end


OutgoingT = TypeVar("OutgoingT", bound=Outgoing)


class KVSender(ABC, Generic[OutgoingT]):
    backend = ""
    device_type: str | None = "cpu"  # the caches it sends from (None: any device)
    outgoing: type[OutgoingT]  # a backend's transfer state

    def __init__(
        self,
        layout: KVLayout,
        *,
        secret: bytes,
        bind: str | None = None,
        advertise: str | None = None,
        checksum=False,
        name: str | None = None,
        part_bytes=4 << 20,
        min_run=4,
    ):
        """``secret``: the cluster's (``kv_transfer/auth.py``); ``bind``/``advertise``:
        this worker's interface and address (``protocol.endpoint``), for a backend whose
        sending side listens too (gloo's pair device, on ``advertise``)."""
        self.layout, self.checksum = layout, checksum
        self.secret = check_secret(secret)
        self.bind, self.advertise = endpoint(bind, advertise)
        self.name = name or f"sender-{uuid.uuid4().hex[:8]}"
        self.part_bytes = part_bytes  # most bytes of K (or of V) in one segment
        self.min_run = min_run
        self.pool = BufferPool(self.device_type or "cpu")
        self._lock = threading.Lock()
        self._transfers: dict[str, OutgoingT] = {}

    # -- public ------------------------------------------------------------------------
    def send_layer(self, transfer_id, layer, k_cache, v_cache, src_block_ids, dst, block_offset=0):
        """A KV layout's share of one layer (``[blocks, block_size, local heads, dim]``
        views of K and V), for the source blocks ``src_block_ids`` at ``block_offset`` of
        the request's block list; returns the bytes handed to the transport."""
        layers = [(layer, k_cache, v_cache)]
        return self.send_layers(transfer_id, layers, src_block_ids, dst, block_offset)

    def send_latent_layer(
        self, transfer_id, layer, latent_cache, src_block_ids, dst, block_offset=0
    ):
        """A latent layout's ``send_layer``: ``latent_cache`` is the layer's ``[blocks,
        block_size, local latent heads * head_dim + rope_dim]`` view of the rank's cache."""
        layers = [(layer, latent_cache)]
        return self.send_layers(transfer_id, layers, src_block_ids, dst, block_offset)

    def send_all(self, transfer_id, kv_cache: torch.Tensor, src_block_ids, dst) -> int:
        """Every layer of this rank's cache (``KVLayout.cache_shape``, either kind) at
        once: backends then copy several layers together."""
        self._check_cache(kv_cache)
        units = self.layout.unit_view(kv_cache)
        layers = [(i, *parts.unbind(0)) for i, parts in enumerate(units.unbind(0))]
        return self._send_units(transfer_id, layers, src_block_ids, dst, 0, units)

    def send_layers(
        self, transfer_id, layers, src_block_ids, dst, block_offset=0, *, kv_cache=None
    ):
        """``send_layer`` for several ``(layer, k_cache, v_cache)`` (``(layer,
        latent_cache)`` for a latent layout); ``kv_cache``: the rank's cache they are
        layers of."""
        if kv_cache is not None:
            self._check_cache(kv_cache)
        want = 1 + self.layout.parts
        if bad := [len(entry) for entry in layers if len(entry) != want]:
            raise KVLayoutError(
                f"a layer to send has {bad[0] - 1} cache tensors; a "
                f"{self.layout.kind!r} layout sends {want - 1} per layer "
                "(send_layer for kv, send_latent_layer for latent)"
            )
        units = [(n, *(self._unit_part(c) for c in caches)) for n, *caches in layers]
        cache = None if kv_cache is None else self.layout.unit_view(kv_cache)
        return self._send_units(transfer_id, units, src_block_ids, dst, block_offset, cache)

    def _send_units(self, transfer_id, layers, src_block_ids, dst, block_offset, cache) -> int:
        """``layers``: ``(layer, *parts)`` in the unit view; ``cache``: the rank's whole
        cache in the unit view when the parts are its layers."""
        t = self._outgoing(transfer_id, dst)
        ids = [int(b) for b in src_block_ids]
        cache = self._check_layers(t, layers, block_offset, cache)
        self._check_blocks(t, ids, block_offset, layers)
        parts = {n: tuple(p) for n, *p in layers}
        source = Source(parts, cache, ids, block_offset, self.layout)
        sent = 0
        for route in routes_from(self.layout, dst.layout.tp_size):
            address = dst.addresses[route.dst_rank]
            per_block = self.layout.block_bytes(route.num_heads)
            max_blocks = max(1, self._part_limit(t, address, route) // per_block)
            # each position for every layer receiving it in turn (a sliding layer may
            # skip the leading blocks, KVDestination.layer_skip): backends copy such runs
            skips = {layer: dst.skip(layer) for layer in parts}
            segments = plan_segments(
                ids, block_offset, skips, route.heads, max_blocks, self.min_run
            )
            self._post(t, route, address, source, segments)
            t.segments[address] = t.segments.get(address, 0) + len(segments)
            sent += self.layout.parts * per_block * sum(s.count for s in segments)
        t.bytes += sent
        t.layers.update(parts)
        return sent

    def finish(self, transfer_id: str, handoff: Handoff | None = None, timeout=60.0) -> TransferAck:
        """End the transfer on every decode rank it went to (the END; source rank 0's
        carries ``handoff``) and wait for their answers: a ``TransferAck`` when each
        says its share landed, else a ``KVTransferError`` (``KVChecksumError``,
        ``KVPeerError``, ``KVTransferTimeout``). Until it returns, the source blocks must
        not be overwritten (a backend may send straight from the cache)."""
        with self._lock:
            t = self._transfers.pop(transfer_id, None)
        if t is None:
            raise KVTransferError(f"finish({transfer_id!r}): nothing was sent for this transfer")
        payload = handoff.to_bytes() if handoff is not None else b""
        try:
            for address in t.segments:
                self._end(t, address, payload)
            acks = self._acks(t, timeout)
        finally:
            for buf in t.buffers:
                self.pool.give(buf)
        for ack in acks:
            if (error := ack.status.error(transfer_id, ack.address, ack.message)) is not None:
                raise error
        seconds, segments = time.monotonic() - t.started, sum(t.segments.values())
        return TransferAck(transfer_id, t.bytes, segments, seconds, tuple(acks))

    def abort(self, transfer_id: str) -> None:
        """Forget a transfer: what was posted may still go (the receiver drops it); no END."""
        with self._lock:
            t = self._transfers.pop(transfer_id, None)
        if t is not None:
            self._abort(t)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- backends ----------------------------------------------------------------------
    @abstractmethod
    def _post(self, t: OutgoingT, route: HeadRoute, address: str, source: Source, segments):
        """Hand segments for one destination rank to the transport. Their bytes stay
        readable until the transfer ends (views of the cache, or pooled buffers)."""

    @abstractmethod
    def _end(self, t: OutgoingT, address: str, handoff: bytes) -> None:
        """Post the transfer's END to one destination rank, after everything posted."""

    @abstractmethod
    def _acks(self, t: OutgoingT, timeout: float) -> list[Ack]:
        """Wait for every END's answer; raise ``KVPeerError`` / ``KVTransferTimeout``."""

    @abstractmethod
    def _disconnect(self, address: str) -> None:
        """Drop the link to the receiver at ``address`` (the next transfer forms one)."""

    @abstractmethod
    def close(self) -> None: ...

    def _abort(self, t: OutgoingT) -> None:  # noqa: B027 - optional
        """Default: nothing to cancel; buffers are dropped (not pooled: still in use)."""

    def _part_limit(self, t: OutgoingT, address: str, route: HeadRoute) -> int:
        """Most bytes of K (or V) in one segment to this destination."""
        return self.part_bytes

    def _sum(self, t: OutgoingT, seg: Segment, *parts: torch.Tensor) -> int:
        """The segment's checksum, taken on the bytes that go out (K's, then V's)."""
        return checksum(*parts)

    # -- checks ------------------------------------------------------------------------
    def _outgoing(self, transfer_id: str, dst: KVDestination) -> OutgoingT:
        with self._lock:
            t = self._transfers.get(transfer_id)
            if t is None:
                self.layout.check_compatible(dst.layout)
                if not dst.token:
                    raise KVLayoutError(
                        f"transfer {transfer_id!r}: the destination has no "
                        "token (KVReceiver.expect mints it)"
                    )
                t = self.outgoing(transfer_id, transfer_key(dst.token), dst)
                self._transfers[transfer_id] = t
            elif t.dst != dst:
                raise KVTransferError(
                    f"transfer {transfer_id!r} already goes to {t.dst.addresses}: use another id"
                )
            return t

    def _check_blocks(self, t: OutgoingT, ids: list[int], offset: int, layers) -> None:
        if not ids:
            raise KVTransferError(f"transfer {t.transfer_id!r}: no source blocks")
        if offset < 0 or offset + len(ids) > len(t.dst.block_ids):
            end, have = offset + len(ids), len(t.dst.block_ids)
            raise KVLayoutError(
                f"transfer {t.transfer_id!r}: blocks [{offset}, {end}), {have} reserved"
            )
        num_blocks = min(p.shape[0] for _, *parts in layers for p in parts)
        if bad := [b for b in ids if not 0 <= b < num_blocks]:
            raise KVLayoutError(f"source blocks {bad[:5]} outside the cache's {num_blocks}")

    def _check_layers(self, t: OutgoingT, layers: Sequence, offset: int, cache):
        """Check each layer sent (its parts in the unit view); returns ``cache`` when the
        layers are views of it (then checked once), else None."""
        if cache is not None:
            base, (step, part_step) = cache.data_ptr(), cache.stride()[:2]
            size = cache.element_size()
        for layer, *parts in layers:
            if not 0 <= layer < self.layout.num_layers:
                raise KVLayoutError(f"layer={layer}: the model has {self.layout.num_layers}")
            if layer in t.layers and offset == 0:
                raise KVTransferError(f"transfer {t.transfer_id!r}: layer {layer} sent twice")
            if cache is not None:
                at = base + layer * step * size
                if all(p.data_ptr() == at + i * part_step * size for i, p in enumerate(parts)):
                    continue
                cache = None  # not its layers: each was checked, and is copied on its own
        return cache

    def _unit_part(self, c: torch.Tensor) -> torch.Tensor:
        """One layer's K, V or latent row cache, checked, in the unit view."""
        lay = self.layout
        want = lay.cache_shape(1)[3:] if lay.kind == "kv" else lay.cache_shape(1)[2:]
        what = "k_cache / v_cache" if lay.kind == "kv" else "latent_cache"
        if c.dim() != 1 + len(want) or tuple(c.shape[1:]) != want or c.dtype != lay.torch_dtype:
            raise KVLayoutError(
                f"{what} is {tuple(c.shape)} {c.dtype}; this rank's layer "
                f"cache is {['blocks', *want]} {lay.dtype}"
            )
        self._check_memory(what, c)
        return c if lay.kind == "kv" else c.unsqueeze(-1)

    def _check_cache(self, cache: torch.Tensor) -> None:
        """The rank's whole cache (``KVLayout.cache_shape``)."""
        self.layout.check_cache(cache)
        self._check_memory("kv_cache", cache)

    def _check_memory(self, name: str, c: torch.Tensor) -> None:
        if not c.is_contiguous():
            raise KVLayoutError(f"{name} must be contiguous (the cache or a layer view of it)")
        if self.device_type is not None and c.device.type != self.device_type:
            raise KVLayoutError(
                f"{name} is on {c.device}; the {self.backend} backend sends "
                f"{self.device_type} tensors"
            )
