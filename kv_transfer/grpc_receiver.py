"""Decode side of the ``grpc`` backend: a ``KVTransfer`` server (on ``bind`` only)
writing each chunk's segments into the cache as they arrive; one stream is one transfer
from one source rank, its END the last message, its answer the ``PushAck``.

A stream's first message names the transfer by its token and proves the cluster's
secret over (token, source layout, nonce) (``kv_transfer/auth.py``); a stream without a
valid proof seen for the first time is answered REJECTED before any of its segments is
looked at, and logged with its peer: no transfer is touched."""

from __future__ import annotations

import logging
import warnings
from concurrent import futures
from dataclasses import dataclass

import grpc
import torch

from kv_transfer import auth
from kv_transfer import kv_transfer_pb2 as pb
from kv_transfer.grpc_sender import CHANNEL_OPTIONS
from kv_transfer.layout import KVLayout, KVLayoutError
from kv_transfer.protocol import KVPeerError, KVTransferError, Status, transfer_key
from kv_transfer.receiver import KVReceiver
from kv_transfer.segment import Segment

log = logging.getLogger(__name__)
MAX_TOKEN = 64  # most characters of a transfer token

# The chunk data is read in place from the (read-only) message bytes; torch warns about
# wrapping a read-only buffer although nothing writes through it.
warnings.filterwarnings("ignore", message="The given buffer is not writable", module=__name__)


@dataclass(eq=False)
class PushLink:
    """One proven stream: the link its segments claim through (``KVReceiver.claim``)."""

    sender: str  # the sending instance, as its proof named it
    peer: str


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

    def __init__(
        self,
        layout: KVLayout,
        kv_cache: torch.Tensor,
        *,
        port: int = 0,
        workers: int = 32,
        **kwargs,
    ):
        super().__init__(layout, kv_cache, **kwargs)
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kv-grpc"),
            options=CHANNEL_OPTIONS,
        )
        handler = grpc.stream_unary_rpc_method_handler(
            self._push,
            request_deserializer=decode_chunk,
            response_serializer=pb.PushAck.SerializeToString,
        )
        self._server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    "pdserve.kv_transfer.KVTransfer", {"Push": handler}
                ),
            )
        )
        wrap = (lambda h: f"[{h}]") if ":" in self.bind else (lambda h: h)
        bound = self._server.add_insecure_port(f"{wrap(self.bind)}:{port}")
        if not bound:
            raise KVPeerError(f"KV receiver cannot listen on {self.bind}:{port}")
        self._address = self._address_of(bound)
        self._seen = auth.Seen()
        self.refused = 0  # streams refused so far
        self._server.start()

    @property
    def address(self) -> str:
        return self._address

    def _push(self, chunks, context) -> pb.PushAck:
        """One stream: each segment is checked and written as it arrives; the answer is
        what ``end`` says of this source's share."""
        key, src, layout, ended, link = None, 0, None, False, None
        status, text = Status.INCOMPLETE, "the stream ended before its END"
        try:
            for head, data in chunks:
                if key is None:
                    if problem := self._unproven(head):
                        self.refused += 1
                        log.warning(
                            "KV receiver %s: push from %s refused (%d so far): %s",
                            self._address,
                            context.peer(),
                            self.refused,
                            problem,
                        )
                        return pb.PushAck(status=Status.REJECTED.name, message=problem)
                    key, layout = (
                        transfer_key(head.transfer_id),
                        KVLayout.from_proto(head.src_layout),
                    )
                    src, link = layout.tp_rank, PushLink(head.sender, context.peer())
                for meta in head.meta:
                    self._segment(key, src, layout, meta, data, link)
                if head.end:
                    status, text = self.end(key, src, head.handoff, link)
                    ended = True
        except KVLayoutError as e:
            status, text = Status.REJECTED, str(e)
        finally:  # a stream that ends without its END: the sender died, or gave up
            if key is not None and not ended:
                self.link_lost(link, src, "the stream ended before its END")
        return pb.PushAck(status=status.name, message=text)

    def _unproven(self, head: pb.KVChunk) -> str:
        """Why a stream's first message does not open a push ("" when it does)."""
        if not 0 < len(head.transfer_id) <= MAX_TOKEN or len(head.nonce) != auth.NONCE_BYTES:
            return "the first message names no transfer token and nonce"
        layout = head.src_layout.SerializeToString(deterministic=True)
        proof = auth.push_proof(self.secret, head.transfer_id, head.sender, layout, head.nonce)
        if not auth.valid(proof, head.proof):
            return "the push does not prove the cluster's secret"
        if not self._seen.first(proof):
            return "the push replays another stream's proof"
        return ""

    def _segment(self, key, src, layout, meta: pb.KVChunkMeta, data: memoryview, link) -> None:
        seg = Segment(
            meta.layer, meta.block_offset, meta.num_blocks, (meta.head_start, meta.head_end)
        )
        claims, _, _ = self.claim(key, src, layout, [seg], link)
        if not claims:
            return  # not expected (any more), or refused: dropped
        lay, ok = self.layout, False
        try:
            shape = (lay.parts, seg.count, lay.block_size, seg.num_heads, lay.unit_dim)
            size = lay.parts * seg.count * lay.block_bytes(seg.num_heads)
            raw = data[meta.offset : meta.offset + size]
            if len(raw) != size:
                raise ValueError(f"{len(raw)} bytes where the segment needs {size}")
            parts = (
                torch.frombuffer(raw, dtype=torch.uint8).view(lay.torch_dtype).view(shape).unbind(0)
            )
            if meta.has_checksum and not self.verify(claims[0], meta.checksum, *parts):
                return
            if self.kv_cache.device.type != "cpu":
                parts = tuple(p.to(self.kv_cache.device) for p in parts)
            self.write(claims[0], *parts)
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
