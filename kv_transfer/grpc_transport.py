"""The ``grpc`` backend: a streaming RPC carrying raw tensor bytes with protobuf metadata.

Works between any two hosts that reach each other over TCP, with no process group.
The decode rank runs a ``KVTransfer`` server; a prefill rank opens one ``Push`` stream
per (transfer, decode rank) on the first segment, feeds it chunks as layers are computed
(``send_layer`` only queues them; gRPC's thread writes them out), and closes it in
``finish``, which returns the server's ``PushAck``.

A chunk is K or V of a run of blocks for one layer and head range, at most
``chunk_bytes`` of data (whole blocks), under the message limits that both ends raise
explicitly (``MAX_MESSAGE``). The wire form is an ordinary ``KVChunk`` message written
with the metadata first and the data last, so neither end copies the data more than
once: the sender joins metadata and tensor memory into the message bytes, the receiver
copies from the message bytes into its cache.
"""

from __future__ import annotations

import collections
import threading
import warnings
from collections.abc import Callable
from concurrent import futures

import grpc
import torch

from kv_transfer.base import Ack, KVReceiver, KVSender, Outgoing, SegmentOut
from kv_transfer.book import Status, transfer_key
from kv_transfer.checksum import checksum, combine
from kv_transfer.errors import KVChecksumError, KVPeerError, KVTransferTimeout
from kv_transfer.handoff import layout_from_proto, layout_to_proto
from kv_transfer.head_map import HeadRoute
from kv_transfer.layout import DTYPES, KVLayout, KVLayoutError
from kv_transfer.proto import kv_transfer_pb2 as pb

METHOD = "/pdserve.kv_transfer.KVTransfer/Push"
KV_BOTH = 2  # KVChunkMeta.kv: the data holds K then V
MAX_MESSAGE = 64 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.max_receive_message_length", MAX_MESSAGE),
]
# The receiver reads chunk data in place from the (read-only) message bytes; torch warns
# about wrapping a read-only buffer although nothing writes through it.
warnings.filterwarnings("ignore", message="The given buffer is not writable", module=__name__)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        bits = value & 0x7F
        value >>= 7
        if value:
            out.append(bits | 0x80)
        else:
            out.append(bits)
            return bytes(out)


def _read_varint(buf, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def encode_chunk(metas: list[pb.KVChunkMeta], parts: list) -> bytes:
    """The bytes of ``KVChunk{meta: metas, data: parts' bytes one after the other}``:
    one copy of the tensors' memory (``parts``: CPU tensors, contiguous)."""
    raws = [p.reshape(-1).view(torch.uint8).numpy() for p in parts]
    out = []
    for meta in metas:
        head = meta.SerializeToString()
        out += [b"\x0a", _varint(len(head)), head]
    out += [b"\x12", _varint(sum(r.nbytes for r in raws)), *raws]
    return b"".join(out)


def decode_chunk(raw: bytes) -> tuple[list[pb.KVChunkMeta], memoryview]:
    """Metas and a zero-copy view of the data of a ``KVChunk``'s bytes (any field order)."""
    view = memoryview(raw)
    try:
        metas, pos = [], 0
        while pos < len(raw) and raw[pos] == 0x0A:
            n, pos = _read_varint(raw, pos + 1)
            metas.append(pb.KVChunkMeta.FromString(view[pos : pos + n].tobytes()))
            pos += n
        if pos == len(raw):
            return metas, view[pos:]
        if raw[pos] == 0x12:
            n, start = _read_varint(raw, pos + 1)
            if start + n == len(raw):
                return metas, view[start:]
    except (IndexError, ValueError):
        pass
    msg = pb.KVChunk.FromString(raw)
    return list(msg.meta), memoryview(msg.data)


class _Stream:
    """The request side of one Push call: a bounded queue of segments that gRPC's sending
    thread drains, packing the segments queued by then (up to ``chunk`` bytes) into each
    message as it goes."""

    def __init__(self, limit: int, chunk: int, encode: Callable[[list], bytes]):
        self.limit, self.chunk, self.encode = limit, chunk, encode
        self.queue: collections.deque[tuple[object, int]] = collections.deque()
        self.queued = 0
        self.closed = False
        self.failed: BaseException | None = None
        self.cond = threading.Condition()
        self.future = None

    def put(self, item: object, size: int) -> None:
        with self.cond:
            while self.queued and self.queued + size > self.limit and not self.failed:
                self.cond.wait()
            if self.failed is not None:
                raise KVPeerError(f"KV push stream failed: {self.failed}")
            self.queue.append((item, size))
            self.queued += size
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self.cond:
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
            items, size = [], 0
            while self.queue and (not items or size + self.queue[0][1] <= self.chunk):
                item, n = self.queue.popleft()
                items.append(item)
                size += n
        msg = self.encode(items)
        with self.cond:
            self.queued -= size
            self.cond.notify_all()
        return msg


class GrpcSender(KVSender):
    """Prefill side over gRPC streams."""

    backend = "grpc"
    device_type = None  # any: device memory goes through host bytes

    def __init__(
        self,
        layout: KVLayout,
        *,
        chunk_bytes: int = 1 << 20,
        max_queued_bytes: int = 256 << 20,
        **kwargs,
    ):
        super().__init__(layout, **kwargs)
        if chunk_bytes > MAX_MESSAGE - (1 << 16):
            raise ValueError(f"chunk_bytes={chunk_bytes} exceeds the message limit")
        self.chunk_bytes = chunk_bytes
        self.max_queued_bytes = max_queued_bytes
        self._channels: dict[str, grpc.Channel] = {}
        self._calls: dict[str, grpc.StreamUnaryMultiCallable] = {}
        self._chan_lock = threading.Lock()
        self._layout_msg = layout_to_proto(layout)

    def _call(self, address: str) -> grpc.StreamUnaryMultiCallable:
        with self._chan_lock:
            call = self._calls.get(address)
            if call is None:
                channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
                call = channel.stream_unary(
                    METHOD,
                    request_serializer=None,  # messages are already bytes (encode_chunk)
                    response_deserializer=pb.PushAck.FromString,
                )
                self._channels[address], self._calls[address] = channel, call
            return call

    def _stream(self, t: Outgoing, address: str) -> _Stream:
        streams = t.extra.setdefault("streams", {})
        stream = streams.get(address)
        if stream is None:
            stream = streams[address] = _Stream(
                self.max_queued_bytes, self.chunk_bytes, lambda items: self._encode(t, items)
            )
            stream.future = self._call(address).future(stream)
            stream.future.add_done_callback(lambda f, s=stream: s.fail(_rpc_error(f)))
        return stream

    def _part_limit(self, address: str, dst_rank: int) -> int:
        return self.chunk_bytes // 2  # a segment's K and V travel in one message

    def _post_segments(
        self, t: Outgoing, route: HeadRoute, address: str, segments: list[SegmentOut]
    ) -> None:
        """Queue the segments; gRPC's sending thread encodes them when the stream is
        ready (so the copy into message bytes runs at the network's pace, not in the
        caller's forward pass), several small ones to a message."""
        stream = self._stream(t, address)
        for seg in segments:
            stream.put((route, seg, self._take_corruption()), 2 * seg.nbytes)

    def _encode(self, t: Outgoing, items: list) -> bytes:
        metas, parts, corrupt, offset = [], [], None, 0
        for route, seg, bad in items:
            k_parts, v_parts = seg.pieces(seg.k_cache), seg.pieces(seg.v_cache)
            if k_parts is None or seg.k_cache.device.type != "cpu" or seg.nbytes % 8:
                # partial heads (or device memory): gather first, then copy into bytes
                k = torch.empty(seg.shape, dtype=seg.k_cache.dtype, device=seg.k_cache.device)
                v = torch.empty_like(k)
                seg.gather_into(k, v)
                k_parts, v_parts = [k.cpu()], [v.cpu()]
            total = 0
            if self.checksum:
                total = combine(*(checksum(p) for p in k_parts + v_parts))
            meta = pb.KVChunkMeta(
                transfer_id=t.transfer_id,
                src_rank=self.layout.tp_rank,
                layer=seg.layer,
                kv=KV_BOTH,
                block_offset=seg.start,
                num_blocks=seg.count,
                head_start=route.heads[0],
                head_end=route.heads[1],
                dtype=self.layout.dtype,
                shape=list(seg.shape),
                has_checksum=self.checksum,
                checksum=total,
                offset=offset,
            )
            meta.src_layout.CopyFrom(self._layout_msg)
            metas.append(meta)
            parts += k_parts + v_parts  # full-head pieces are gathered by the join itself
            if bad and corrupt is None:
                corrupt = offset
            offset += 2 * seg.nbytes
        msg = encode_chunk(metas, parts)
        if corrupt is not None:  # testing aid: one bit off (in that segment) after its checksum
            flipped = bytearray(msg)
            flipped[len(msg) - offset + corrupt] ^= 1
            msg = bytes(flipped)
        return msg

    def _finish(self, t: Outgoing, timeout: float | None) -> list[Ack]:
        streams: dict[str, _Stream] = t.extra.get("streams", {})
        for stream in streams.values():
            stream.close()
        acks = []
        for address, stream in streams.items():
            try:
                reply = stream.future.result(timeout=timeout)
            except grpc.FutureTimeoutError as e:
                stream.future.cancel()
                raise KVTransferTimeout(
                    f"KV transfer {t.transfer_id!r} to {address}: no acknowledgement "
                    f"within {timeout}s"
                ) from e
            except grpc.RpcError as e:
                raise KVPeerError(
                    f"KV transfer {t.transfer_id!r} to {address} failed: {_rpc_text(e)}"
                ) from e
            acks.append(Ack(address, Status(reply.status), reply.message))
        return acks

    def _abort(self, t: Outgoing) -> None:
        for stream in t.extra.get("streams", {}).values():
            stream.close()
            stream.future.cancel()

    def close(self) -> None:
        with self._chan_lock:
            channels, self._channels, self._calls = list(self._channels.values()), {}, {}
        for channel in channels:
            channel.close()


def _rpc_error(future) -> BaseException | None:
    if future.cancelled():
        return KVPeerError("push cancelled")
    return future.exception()


def _rpc_text(e: grpc.RpcError) -> str:
    code = e.code() if hasattr(e, "code") else None
    details = e.details() if hasattr(e, "details") else str(e)
    return f"{code.name if code else 'error'}: {details}"


class GrpcReceiver(KVReceiver):
    """Decode side: a ``KVTransfer`` gRPC server writing chunks into this rank's cache."""

    backend = "grpc"

    def __init__(
        self,
        layout: KVLayout,
        kv_cache: torch.Tensor,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        workers: int = 32,
    ):
        super().__init__(layout, kv_cache)
        self.device = kv_cache.device
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kv-grpc"),
            options=CHANNEL_OPTIONS,
        )
        handler = grpc.method_handlers_generic_handler(
            "pdserve.kv_transfer.KVTransfer",
            {
                "Push": grpc.stream_unary_rpc_method_handler(
                    self._push,
                    request_deserializer=decode_chunk,
                    response_serializer=pb.PushAck.SerializeToString,
                )
            },
        )
        self._server.add_generic_rpc_handlers((handler,))
        bound = self._server.add_insecure_port(f"{host}:{port}")
        if not bound:
            raise KVPeerError(f"KV receiver cannot listen on {host}:{port}")
        self._address = f"{host}:{bound}"
        self._server.start()

    @property
    def address(self) -> str:
        return self._address

    def _push(self, chunks, context) -> pb.PushAck:
        """One stream: one transfer from one source rank; every segment is checked and
        copied into the cache as it arrives; the answer says how this source's share
        stands."""
        state = {"tid": "", "key": 0, "src": 0, "layout": None, "rejected": "", "segments": 0}
        nbytes = 0
        for metas, data in chunks:
            nbytes += len(data)
            for meta in metas:
                self._segment(state, meta, data)
        tid, key, src = state["tid"], state["key"], state["src"]
        if state["rejected"]:
            status, text = Status.REJECTED, state["rejected"]
        elif not tid:
            status, text = Status.UNKNOWN, "empty stream"
        else:
            status, text = self.book.source_status(key, src)
        return pb.PushAck(
            transfer_id=tid,
            status=int(status),
            bytes=nbytes,
            chunks=state["segments"],
            message=text,
        )

    def _segment(self, state: dict, meta: pb.KVChunkMeta, data: memoryview) -> None:
        if not state["tid"]:
            tid = meta.transfer_id
            state.update(tid=tid, key=transfer_key(tid), src=meta.src_rank)
            try:
                state["layout"] = layout_from_proto(meta.src_layout)
            except KVLayoutError as e:
                state["rejected"] = str(e)
        if state["rejected"]:
            return
        tid, key, src = state["tid"], state["key"], state["src"]
        if meta.transfer_id != tid or meta.src_rank != src:
            state["rejected"] = "one stream must carry one transfer from one source rank"
            return
        state["segments"] += 1
        try:
            dtype = DTYPES[meta.dtype]
            shape = tuple(meta.shape)
            n = 2 if meta.kv == KV_BOTH else 1
            size = n * dtype.itemsize
            for s in shape:
                size *= s
            raw = data[meta.offset : meta.offset + size]
            tensor = torch.frombuffer(raw, dtype=torch.uint8).view(dtype).view(n, *shape)
        except (KeyError, RuntimeError, ValueError) as e:
            self.book.fail(key, KVChecksumError(f"KV transfer {tid!r}: malformed chunk: {e}"))
            return
        parts = tensor.unbind(0)
        if meta.has_checksum:
            got = combine(*(checksum(part) for part in parts))
            if got != meta.checksum:
                self.book.fail(
                    key,
                    KVChecksumError(
                        f"KV transfer {tid!r}: checksum mismatch in layer {meta.layer}, "
                        f"blocks [{meta.block_offset}, {meta.block_offset + meta.num_blocks}) "
                        f"from source rank {src}: sent {meta.checksum:#018x}, "
                        f"received {got:#018x}"
                    ),
                )
                return
        sync = None
        if self.device.type != "cpu":
            parts = tuple(part.to(self.device) for part in parts)
            sync = torch.cuda.current_stream(self.device).synchronize
        kvs = (0, 1) if meta.kv == KV_BOTH else (meta.kv,)
        for kv, part in zip(kvs, parts, strict=True):
            self.book.deliver(
                key,
                src,
                state["layout"],
                meta.layer,
                kv,
                meta.block_offset,
                meta.num_blocks,
                (meta.head_start, meta.head_end),
                part,
                sync=sync,
            )

    def close(self) -> None:
        self._server.stop(grace=None).wait(5)
