"""Prefill side of the ``grpc`` backend: one ``Push`` stream per (transfer, decode rank)."""

from __future__ import annotations

import threading

import grpc
import torch

from kv_transfer.checksum import checksum, combine
from kv_transfer.errors import KVPeerError, KVTransferTimeout
from kv_transfer.grpc_transport.stream import PushStream
from kv_transfer.grpc_transport.wire import (
    CHANNEL_OPTIONS,
    KV_BOTH,
    MAX_MESSAGE,
    METHOD,
    encode_chunk,
)
from kv_transfer.handoff import layout_to_proto
from kv_transfer.head_map import HeadRoute
from kv_transfer.layout import KVLayout
from kv_transfer.outgoing import Outgoing, SegmentOut
from kv_transfer.pending import Status
from kv_transfer.proto import kv_transfer_pb2 as pb
from kv_transfer.sender import Ack, KVSender


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

    def _stream(self, t: Outgoing, address: str) -> PushStream:
        streams = t.extra.setdefault("streams", {})
        stream = streams.get(address)
        if stream is None:
            stream = streams[address] = PushStream(
                self.max_queued_bytes, self.chunk_bytes, lambda items: self._encode(t, items)
            )
            stream.future = self._call(address).future(stream)
            stream.future.add_done_callback(lambda f, s=stream: s.fail(_rpc_error(f)))
        return stream

    def _part_limit(self, t: Outgoing, address: str, dst_rank: int) -> int:
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
        streams: dict[str, PushStream] = t.extra.get("streams", {})
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
