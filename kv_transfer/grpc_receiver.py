"""Decode side of the ``grpc`` backend: a ``KVTransfer`` server writing each chunk's
segments into the cache as they arrive; one stream is one transfer from one source rank,
its END the last message, its answer the ``PushAck``."""

from __future__ import annotations

import warnings
from concurrent import futures

import grpc
import torch

from kv_transfer import kv_transfer_pb2 as pb
from kv_transfer.grpc_sender import CHANNEL_OPTIONS
from kv_transfer.layout import KVLayout, KVLayoutError
from kv_transfer.protocol import KVPeerError, KVTransferError, Status, kv_host, transfer_key
from kv_transfer.receiver import KVReceiver
from kv_transfer.segment import Segment

# The chunk data is read in place from the (read-only) message bytes; torch warns about
# wrapping a read-only buffer although nothing writes through it.
warnings.filterwarnings("ignore", message="The given buffer is not writable", module=__name__)


def _read_varint(buf, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def decode_chunk(raw: bytes) -> tuple[pb.KVChunk, memoryview]:
    """A ``KVChunk``'s fields but ``data``, and a zero-copy view of its data (any field
    order; every field number is below 16, so each tag is one byte)."""
    view, pos, rest, data = memoryview(raw), 0, [], memoryview(b"")
    try:
        while pos < len(raw):
            tag = raw[pos]
            value, end = _read_varint(raw, pos + 1)
            if tag & 7 == 2:  # length-delimited: value is the length
                end += value
            elif tag & 7 != 0:
                raise ValueError(f"wire type {tag & 7}")
            if tag == 0x12:
                data = view[end - value : end]
            else:
                rest.append(view[pos:end])
            pos = end
        if pos != len(raw):
            raise ValueError("truncated")
        return pb.KVChunk.FromString(b"".join(rest)), data
    except (IndexError, ValueError):
        msg = pb.KVChunk.FromString(raw)  # raises DecodeError on bytes that are no KVChunk
        return msg, memoryview(msg.data)


class GrpcReceiver(KVReceiver):
    """Decode side: a ``KVTransfer`` gRPC server writing chunks into this rank's cache."""

    backend = "grpc"

    def __init__(self, layout: KVLayout, kv_cache: torch.Tensor, *, host: str | None = None,
                 port: int = 0, workers: int = 32, **kwargs):  # fmt: skip
        super().__init__(layout, kv_cache, **kwargs)
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kv-grpc"),
            options=CHANNEL_OPTIONS,
        )
        handler = grpc.stream_unary_rpc_method_handler(
            self._push, request_deserializer=decode_chunk,
            response_serializer=pb.PushAck.SerializeToString,
        )  # fmt: skip
        self._server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    "pdserve.kv_transfer.KVTransfer", {"Push": handler}
                ),
            )
        )
        host = host or kv_host()
        bound = self._server.add_insecure_port(f"{host}:{port}")
        if not bound:
            raise KVPeerError(f"KV receiver cannot listen on {host}:{port}")
        self._address = f"{host}:{bound}"
        self._server.start()

    @property
    def address(self) -> str:
        return self._address

    def _push(self, chunks, context) -> pb.PushAck:
        """One stream: each segment is checked and written as it arrives; the answer is
        what ``end`` says of this source's share."""
        key, src, layout, ended = None, 0, None, False
        status, text = Status.INCOMPLETE, "the stream ended before its END"
        try:
            for head, data in chunks:
                if key is None:
                    key, layout = (
                        transfer_key(head.transfer_id),
                        KVLayout.from_proto(head.src_layout),
                    )
                    src = layout.tp_rank
                for meta in head.meta:
                    self._segment(key, src, layout, meta, data, context)
                if head.end:
                    status, text = self.end(key, src, head.handoff, context)
                    ended = True
        except KVLayoutError as e:
            status, text = Status.REJECTED, str(e)
        finally:  # a stream that ends without its END: the sender died, or gave up
            if key is not None and not ended:
                self.link_lost(context, src, "the stream ended before its END")
        return pb.PushAck(status=int(status), message=text)

    def _segment(self, key, src, layout, meta: pb.KVChunkMeta, data: memoryview, link) -> None:
        seg = Segment(
            meta.layer, meta.block_offset, meta.num_blocks, (meta.head_start, meta.head_end)
        )
        claims, _, _ = self.claim(key, src, layout, [seg], link)
        if not claims:
            return  # not expected (any more), or refused: dropped
        lay, ok = self.layout, False
        try:
            shape = (2, seg.count, lay.block_size, seg.num_heads, lay.head_dim)
            size = (
                lay.torch_dtype.itemsize * seg.count * lay.block_size * seg.num_heads * lay.head_dim
            )
            raw = data[meta.offset : meta.offset + 2 * size]
            if len(raw) != 2 * size:
                raise ValueError(f"{len(raw)} bytes where the segment needs {2 * size}")
            k, v = (
                torch.frombuffer(raw, dtype=torch.uint8).view(lay.torch_dtype).view(shape).unbind(0)
            )
            if meta.has_checksum and not self.verify(claims[0], meta.checksum, k, v):
                return
            if self.kv_cache.device.type != "cpu":
                k, v = k.to(self.kv_cache.device), v.to(self.kv_cache.device)
            self.write(claims[0], k, v)
            if self.kv_cache.device.type != "cpu":
                torch.cuda.current_stream(self.kv_cache.device).synchronize()
            ok = True
        except (RuntimeError, ValueError) as e:
            self.fail(key, KVTransferError(f"KV transfer {key:#x}: malformed chunk: {e}"))
        finally:
            self.commit(claims, ok)

    def close(self) -> None:
        super().close()
        self._server.stop(grace=None).wait(5)
