"""Prefill side of the ``grpc`` backend: one ``Push`` stream per (transfer, decode rank).

``_post`` only queues segments; gRPC's sending thread encodes them when the stream is
ready, several to a ``KVChunk`` of up to ``chunk_bytes``, reading the blocks straight
out of the cache into the message bytes (one copy), so the copy runs at the network's
pace, not in the forward pass. The message is written with its metadata first and its
data last (``encode_chunk``), so the receiver reads the data in place; the END is the
stream's last message, and the stream's close brings the receiver's ``PushAck``. The
first message names the transfer by its destination's token and this instance, and
proves the cluster's secret over (token, name, source layout, a fresh nonce)
(``kv_transfer/auth.py``). Before it, the call opens with the gate's metadata and the
receiver's answer is checked (``kv_transfer/grpc_gate.py``).
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field
from typing import cast

import grpc
import torch

from pdserve.kv_transfer import auth
from pdserve.kv_transfer import grpc_gate as gate
from pdserve.kv_transfer import kv_transfer_pb2 as pb
from pdserve.kv_transfer.grpc_tls import TLSFiles
from pdserve.kv_transfer.layout import KVLayout
from pdserve.kv_transfer.protocol import KVPeerError, KVTransferTimeout, Status
from pdserve.kv_transfer.segment import Source
from pdserve.kv_transfer.sender import Ack, KVSender, Outgoing

METHOD = "/pdserve.kv_transfer.KVTransfer/Push"
MAX_MESSAGE = 64 << 20  # both ends raise gRPC's message limits to this, explicitly
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.max_receive_message_length", MAX_MESSAGE),
]


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    return bytes(out + bytes([value]))


def encode_chunk(head: pb.KVChunk, metas: list[pb.KVChunkMeta], parts: list) -> bytes:
    """The bytes of ``head`` (a ``KVChunk`` without meta and data) plus ``meta: metas`` and
    ``data: parts' bytes one after the other``, the data last: one copy of the tensors'
    memory (``parts``: contiguous CPU tensors)."""
    raws = [p.reshape(-1).view(torch.uint8).numpy() for p in parts]
    out = [head.SerializeToString()]
    for meta in metas:
        raw = meta.SerializeToString()
        out += [b"\x0a", _varint(len(raw)), raw]
    out += [b"\x12", _varint(sum(r.nbytes for r in raws)), *raws]
    return b"".join(out)


class PushStream:
    """The request side of one Push call: a bounded queue of items that gRPC's sending
    thread drains, encoding the items queued by then (up to ``chunk`` bytes) into each
    message as it goes. A ``put`` that finds the queue full for ``stall_s`` (the
    receiver stopped reading) fails the stream rather than hold the forward pass.

    Before its first message the stream waits for the receiver's answer (the call's
    initial metadata) and asks ``trusted`` whether it proves the secret; if not, the
    stream fails and the call is cancelled: no KV byte goes to a receiver that cannot
    sign. ``failed`` keeps the first reason the stream failed."""

    def __init__(self, limit: int, chunk: int, encode, trusted, stall_s: float = 30.0):
        self.limit, self.chunk, self.encode, self.stall_s = limit, chunk, encode, stall_s
        self.trusted, self.verified = trusted, False
        self.queue: collections.deque = collections.deque()
        self.queued, self.closed, self.failed = 0, False, None
        self.cond = threading.Condition()
        # the call reading this stream, set by the sender right after it starts the call
        self.future: grpc.Future[pb.PushAck]

    def put(self, item, size: int) -> None:
        with self.cond:
            full = lambda: self.queued and self.queued + size > self.limit
            if not self.cond.wait_for(lambda: not full() or self.failed, self.stall_s):
                self.fail(f"no progress for {self.stall_s:g}s")  # ends the iterator, the call
            if self.failed is not None:
                raise KVPeerError(f"KV push stream failed: {self.failed}")
            self.queue.append((item, size))
            self.queued += size
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def fail(self, error) -> None:
        with self.cond:
            if self.failed is None:
                self.failed = error
            self.closed = True
            self.queue.clear()
            self.queued = 0
            self.cond.notify_all()

    def __iter__(self):
        return self

    def __next__(self) -> bytes:
        with self.cond:
            while not self.queue and not self.closed:
                self.cond.wait()
            if not self.queue:
                raise StopIteration
        if not self.verified:  # the queue has items: ``future`` is set
            call = cast(grpc.Call, self.future)  # a call's future is also its Call
            if not self.trusted(call.initial_metadata()):
                self.fail("the receiver did not prove the cluster's secret")
                self.future.cancel()
                raise StopIteration
            self.verified = True
        with self.cond:
            if not self.queue:
                raise StopIteration
            items: list[object] = []
            size = 0
            while self.queue and (not items or size + self.queue[0][1] <= self.chunk):
                item, n = self.queue.popleft()
                items.append(item)
                size += n
        msg = self.encode(items)
        with self.cond:
            self.queued -= size
            self.cond.notify_all()
        return msg


@dataclass(eq=False)
class GrpcOutgoing(Outgoing):
    streams: dict[str, PushStream] = field(default_factory=dict)  # per address
    opened: set[str] = field(default_factory=set)  # streams whose first message went


class GrpcSender(KVSender[GrpcOutgoing]):
    """Prefill side over gRPC streams."""

    backend = "grpc"
    device_type = None  # any: device memory goes through host bytes
    outgoing = GrpcOutgoing

    def __init__(
        self,
        layout: KVLayout,
        *,
        chunk_bytes=1 << 20,
        max_queued_bytes=256 << 20,
        tls: TLSFiles | None = None,
        **kwargs,
    ):
        """``tls``: dial receivers with mTLS (``grpc_tls.py``), else in plain text."""
        super().__init__(layout, **kwargs)
        self._credentials = None if tls is None else tls.channel()
        if chunk_bytes > MAX_MESSAGE - (1 << 16):
            raise ValueError(f"chunk_bytes={chunk_bytes} exceeds the message limit")
        self.chunk_bytes, self.max_queued_bytes = chunk_bytes, max_queued_bytes
        self._channels: dict[str, grpc.Channel] = {}
        self._lock_channels = threading.Lock()

    def _stream(self, t: GrpcOutgoing, address: str) -> PushStream:
        stream = t.streams.get(address)
        if stream is None:
            with self._lock_channels:
                if address not in self._channels:
                    self._channels[address] = (
                        grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
                        if self._credentials is None
                        else grpc.secure_channel(address, self._credentials, CHANNEL_OPTIONS)
                    )
                call: grpc.StreamUnaryMultiCallable[bytes, pb.PushAck]
                call = self._channels[address].stream_unary(
                    METHOD, request_serializer=None, response_deserializer=pb.PushAck.FromString
                )
            opened = gate.opening(self.secret, self.name, address)
            stream = t.streams[address] = PushStream(
                self.max_queued_bytes,
                self.chunk_bytes,
                lambda items: self._encode(t, address, items),
                lambda answer: gate.answered(self.secret, address, opened, answer),
            )
            stream.future = call.future(stream, metadata=opened)
            stream.future.add_done_callback(lambda f: stream.fail(_rpc_error(f)))
        return stream

    def _part_limit(self, t, address, route) -> int:
        return self.chunk_bytes // 2  # a segment's K and V travel in one message

    def _post(self, t: GrpcOutgoing, route, address: str, source: Source, segments) -> None:
        stream = self._stream(t, address)
        per = self.layout.parts * self.layout.block_bytes(1)
        for seg in segments:
            stream.put((source, seg), seg.count * seg.num_heads * per)

    def _end(self, t: GrpcOutgoing, address: str, handoff: bytes) -> None:
        stream = self._stream(t, address)
        stream.put((None, handoff), 0)
        stream.close()

    def _encode(self, t: GrpcOutgoing, address: str, items: list) -> bytes:
        head = pb.KVChunk()
        if address not in t.opened:  # the stream's first message names the transfer
            t.opened.add(address)
            head.transfer_id, head.sender, head.nonce = t.dst.token, self.name, auth.new_nonce()
            self.layout.to_proto(head.src_layout)
            layout = head.src_layout.SerializeToString(deterministic=True)
            head.proof = auth.push_proof(
                self.secret, head.transfer_id, self.name, layout, head.nonce
            )
        metas, parts, offset = [], [], 0
        for source, item in items:
            if source is None:  # the END
                head.end, head.handoff = True, item
                continue
            seg = item
            pieces = source.pieces(seg)
            if pieces is None or pieces[0].device.type != "cpu" or pieces[0][0].nbytes % 8:
                # partial heads, device memory, or blocks whose checksum words would not
                # add up across pieces: gather first, then copy into bytes
                device = source.layers[seg.layer][0].device
                pieces = [
                    torch.empty(source.shape(seg), dtype=self.layout.torch_dtype, device=device)
                    for _ in range(self.layout.parts)
                ]
                source.gather(seg, pieces)
                pieces = [p.cpu() for p in pieces]
            meta = pb.KVChunkMeta(
                layer=seg.layer,
                block_offset=seg.start,
                num_blocks=seg.count,
                head_start=seg.heads[0],
                head_end=seg.heads[1],
            )
            meta.offset = offset
            if self.checksum:
                meta.has_checksum = True
                meta.checksum = self._sum(t, seg, *pieces)
            metas.append(meta)
            parts += pieces
            offset += sum(p.numel() * p.element_size() for p in pieces)
        return encode_chunk(head, metas, parts)

    def _acks(self, t: GrpcOutgoing, timeout: float) -> list[Ack]:
        acks = []
        for address in t.segments:
            stream = t.streams[address]
            try:
                reply = stream.future.result(timeout=timeout)
            except grpc.FutureTimeoutError as e:
                stream.future.cancel()
                raise KVTransferTimeout(
                    f"KV transfer {t.transfer_id!r} to {address}: no "
                    f"acknowledgement within {timeout}s"
                ) from e
            except (grpc.RpcError, grpc.FutureCancelledError) as e:
                why = stream.failed if isinstance(stream.failed, str) else _rpc_text(e)
                raise KVPeerError(
                    f"KV transfer {t.transfer_id!r} to {address} failed: {why}"
                ) from e
            acks.append(Ack(address, Status(reply.status), reply.message))
        return acks

    def _abort(self, t: GrpcOutgoing) -> None:
        for stream in t.streams.values():
            stream.close()
            stream.future.cancel()

    def _disconnect(self, address: str) -> None:
        with self._lock_channels:
            channel = self._channels.pop(address, None)
        if channel is not None:
            channel.close()  # its calls in flight end with CANCELLED

    def close(self) -> None:
        for address in list(self._channels):
            self._disconnect(address)


def _rpc_error(future) -> BaseException | None:
    return KVPeerError("push cancelled") if future.cancelled() else future.exception()


def _rpc_text(e) -> str:
    code = e.code() if hasattr(e, "code") else None
    details = e.details() if hasattr(e, "details") else str(e)
    return f"{code.name if code else type(e).__name__}: {details}"
