"""``KVSender``: the prefill side every backend shares (checks, segment planning per
destination rank, the transfer's state and acknowledgements); backends implement
``_post_segments`` and ``_finish``. The contract is in ``kv_transfer/base.py``."""

from __future__ import annotations

import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kv_transfer.blocks import BufferPool, plan_segments
from kv_transfer.errors import KVChecksumError, KVTransferError
from kv_transfer.handoff import KVDestination
from kv_transfer.head_map import HeadRoute, routes_from
from kv_transfer.layout import KVLayout, KVLayoutError
from kv_transfer.outgoing import Outgoing, SegmentOut
from kv_transfer.pending import Status, transfer_key


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
    """Prefill side of one tensor-parallel rank (the contract: ``kv_transfer/base.py``)."""

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
        layer-wise): backends coalesce the layers into fewer, larger messages."""
        self._check_tensor("kv_cache", kv_cache, 6)
        layers = [(i, *kv.unbind(0)) for i, kv in enumerate(kv_cache.unbind(0))]
        return self.send_layers(transfer_id, layers, src_block_ids, dst, kv_cache=kv_cache)

    def send_layers(
        self,
        transfer_id: str,
        layers: Sequence[tuple[int, torch.Tensor, torch.Tensor]],
        src_block_ids: Sequence[int],
        dst: KVDestination,
        block_offset: int = 0,
        *,
        kv_cache: torch.Tensor | None = None,
    ) -> int:
        """``send_layer`` for several ``(layer, k_cache, v_cache)`` at once. With
        ``kv_cache`` (the ``[layers, 2, ...]`` cache they are layers of), backends may copy
        several layers at once."""
        t = self._outgoing(transfer_id, dst)
        ids = [int(b) for b in src_block_ids]
        kv_cache = self._check_layers(t, layers, block_offset, kv_cache)
        self._check_blocks(t, ids, block_offset, layers)
        sent = 0
        for route in routes_from(self.layout, dst.tp_size):
            address = dst.addresses[route.dst_rank]
            per_block = self.layout.block_bytes(route.num_heads)
            max_blocks = max(1, self._part_limit(t, address, route.dst_rank) // per_block)
            plan = plan_segments(ids, max_blocks, self.min_run, block_offset)
            out: list[SegmentOut] = []
            full = route.src_heads == (0, self.layout.heads_per_rank)
            for seg in plan:  # each position for every layer: backends copy such runs at once
                seg_ids = ids[seg.start - block_offset : seg.start - block_offset + seg.count]
                shape = (seg.count, self.layout.block_size, route.num_heads, self.layout.head_dim)
                nbytes, zero_copy = seg.count * per_block, seg.contiguous and full
                for layer, k_cache, v_cache in layers:
                    out.append(
                        SegmentOut(
                            layer, seg.start, seg.count, k_cache, v_cache, seg_ids,
                            route.src_heads, seg.contiguous, shape, nbytes, zero_copy, kv_cache,
                        )
                    )  # fmt: skip
                sent += 2 * nbytes * len(layers)
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

    def _part_limit(self, t: Outgoing, address: str, dst_rank: int) -> int:
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

    def _check_blocks(self, t: Outgoing, ids: list[int], block_offset: int, layers) -> None:
        if not ids:
            raise KVTransferError(f"transfer {t.transfer_id!r}: no source blocks")
        if block_offset < 0 or block_offset + len(ids) > len(t.dst.block_ids):
            raise KVLayoutError(
                f"transfer {t.transfer_id!r}: blocks [{block_offset}, "
                f"{block_offset + len(ids)}) but only {len(t.dst.block_ids)} are reserved"
            )
        num_blocks = min((min(k.shape[0], v.shape[0]) for _, k, v in layers), default=0)
        if min(ids) < 0 or max(ids) >= num_blocks:
            bad = [b for b in ids if not 0 <= b < num_blocks]
            raise KVLayoutError(f"source blocks {bad[:5]} outside the cache's {num_blocks}")

    def _check_layers(self, t, layers, block_offset, kv_cache):
        """Check each layer sent; returns ``kv_cache`` when the layers are views of it
        (checked once then), else None."""
        if kv_cache is not None:
            self._check_tensor("kv_cache", kv_cache, 6)
            base, (step, kv_step) = kv_cache.data_ptr(), kv_cache.stride()[:2]
            size = kv_cache.element_size()
        for layer, k_cache, v_cache in layers:
            lay = self.layout
            if not 0 <= layer < lay.num_layers:
                raise KVLayoutError(f"layer={layer} is outside the model's {lay.num_layers} layers")
            if layer in t.layers and block_offset == 0:
                raise KVTransferError(f"transfer {t.transfer_id!r}: layer {layer} sent twice")
            if kv_cache is not None:
                at = base + layer * step * size
                if k_cache.data_ptr() == at and v_cache.data_ptr() == at + kv_step * size:
                    continue
                kv_cache = None  # not its layers: each is checked, and copied on its own
            self._check_tensor("k_cache", k_cache, 4)
            self._check_tensor("v_cache", v_cache, 4)
        return kv_cache

    def _check_tensor(self, name: str, c: torch.Tensor, dim: int) -> None:
        """A layer's K or V cache (``dim`` 4), or the rank's whole cache (6)."""
        lay = self.layout
        want = (lay.block_size, lay.heads_per_rank, lay.head_dim)
        lead_ok = dim == 4 or tuple(c.shape[:2]) == (lay.num_layers, 2)
        if (
            c.dim() != dim
            or tuple(c.shape[-3:]) != want
            or c.dtype != lay.torch_dtype
            or not lead_ok
        ):
            lead = "blocks" if dim == 4 else f"{lay.num_layers}, 2, blocks"
            raise KVLayoutError(
                f"{name} is {tuple(c.shape)} {c.dtype}; this rank's cache is "
                f"[{lead}, {want[0]}, {want[1]}, {want[2]}] {lay.dtype}"
            )
        if not c.is_contiguous():
            raise KVLayoutError(f"{name} must be contiguous (the cache or a layer view of it)")
        if self.device_type is not None and c.device.type != self.device_type:
            raise KVLayoutError(
                f"{name} is on {c.device}; the {self.backend} backend sends "
                f"{self.device_type} tensors"
            )

    def _take_corruption(self) -> bool:
        """Whether the segment being posted is to be corrupted (after its checksum)."""
        if self._corrupt_next <= 0:
            return False
        self._corrupt_next -= 1
        return True
