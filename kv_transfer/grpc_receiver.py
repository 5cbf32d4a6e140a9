"""Decode side of the ``grpc`` backend: a ``KVTransfer`` server (on ``bind`` only)
writing each chunk's segments into the cache as they arrive; one stream is one transfer
from one source rank, its END the last message, its answer the ``PushAck``.

A stream is admitted by its call's metadata before any message of it is read, and
answers the sender's challenge (``kv_transfer/grpc_gate.py``); its first message then
names the transfer by its token and proves the cluster's secret over (token, sender,
source layout, nonce) (``kv_transfer/auth.py``). A stream failing either proof, or
replaying one, is answered REJECTED before any of its segments is looked at, and logged
with its peer: no transfer is touched."""

from __future__ import annotations

import asyncio
import logging
import threading
import warnings
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import torch

from pdserve.kv_transfer import auth
from pdserve.kv_transfer import grpc_gate as gate
from pdserve.kv_transfer import kv_transfer_pb2 as pb
from pdserve.kv_transfer.grpc_sender import CHANNEL_OPTIONS
from pdserve.kv_transfer.grpc_tls import TLSFiles
from pdserve.kv_transfer.layout import KVLayout, KVLayoutError
from pdserve.kv_transfer.protocol import KVPeerError, KVTransferError, Status, transfer_key
from pdserve.kv_transfer.receiver import KVReceiver
from pdserve.kv_transfer.segment import Segment

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


@dataclass(eq=False)
class _Push:
    """What one admitted stream knows so far; ``key`` is None until its first message
    opened a push. Touched by one message at a time (the stream's messages are taken in
    order, each awaited)."""

    sender: str
    peer: str
    key: int | None = None
    src: int = 0
    layout: KVLayout | None = None
    ended: bool = False
    status: Status = Status.INCOMPLETE
    text: str = "the stream ended before its END"
    link: PushLink = field(init=False)

    def __post_init__(self):
        self.link = PushLink(self.sender, self.peer)


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
    """Decode side: a ``KVTransfer`` gRPC server writing chunks into this rank's cache.

    The server is asyncio (``grpc.aio``, its own event loop thread): a stream holds no
    thread while it waits, so idle streams cost memory only. A stream passes the gate
    (``grpc_gate.admit``) before a message of it is read, and must bring its first
    message within ``first_message_s`` or be answered INCOMPLETE; each message is then
    checked and written on one of ``workers`` threads, held only while it is. With
    ``tls`` it listens with mTLS only (``grpc_tls.py``)."""

    backend = "grpc"

    def __init__(
        self,
        layout: KVLayout,
        kv_cache: torch.Tensor,
        *,
        port: int = 0,
        workers: int = 32,
        first_message_s: float = 10.0,
        tls: TLSFiles | None = None,
        **kwargs,
    ):
        super().__init__(layout, kv_cache, **kwargs)
        self.first_message_s, self.tls = first_message_s, tls
        self._pool = futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kv-grpc")
        self._seen, self._seen_streams = auth.Seen(), auth.Seen()
        self.refused = 0  # streams refused so far
        self._lock_refused = threading.Lock()  # refusals come from the loop and the workers
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="kv-grpc-loop", daemon=True
        )
        self._thread.start()
        try:
            start = asyncio.run_coroutine_threadsafe(self._start(port), self._loop)
            self._server, self._address = start.result(30)
        except BaseException:
            self._stop_loop()
            raise

    async def _start(self, port: int) -> tuple[grpc.aio.Server, str]:
        server = grpc.aio.server(options=CHANNEL_OPTIONS)
        handler = grpc.stream_unary_rpc_method_handler(
            self._push,
            request_deserializer=decode_chunk,
            response_serializer=pb.PushAck.SerializeToString,
        )
        server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    "pdserve.kv_transfer.KVTransfer", {"Push": handler}
                ),
            )
        )
        wrap = (lambda h: f"[{h}]") if ":" in self.bind else (lambda h: h)
        where = f"{wrap(self.bind)}:{port}"
        if self.tls is None:
            bound = server.add_insecure_port(where)
        else:
            bound = server.add_secure_port(where, self.tls.server())
        if not bound:
            raise KVPeerError(f"KV receiver cannot listen on {self.bind}:{port}")
        await server.start()
        return server, self._address_of(bound)

    @property
    def address(self) -> str:
        return self._address

    def _refuse(self, peer: str, problem: str) -> pb.PushAck:
        with self._lock_refused:
            self.refused += 1
            refused = self.refused
        log.warning(
            "KV receiver %s: push from %s refused (%d so far): %s",
            self._address,
            peer,
            refused,
            problem,
        )
        return pb.PushAck(status=Status.REJECTED.name, message=problem)

    async def _push(self, chunks, context: grpc.aio.ServicerContext) -> pb.PushAck:
        """One stream: admitted by its metadata, then each segment checked and written
        as it arrives; the answer is what ``end`` says of this source's share."""
        admitted = gate.admit(
            self.secret, self._address, context.invocation_metadata() or (), self._seen_streams
        )
        if isinstance(admitted, str):
            return self._refuse(context.peer(), admitted)
        await context.send_initial_metadata(gate.answer(self.secret, self._address, admitted))
        push = _Push(admitted.sender, context.peer())
        loop, messages = asyncio.get_running_loop(), chunks.__aiter__()
        try:
            try:
                first = await asyncio.wait_for(messages.__anext__(), self.first_message_s)
            except (TimeoutError, StopAsyncIteration):
                return pb.PushAck(
                    status=Status.INCOMPLETE.name,
                    message=f"no first message within {self.first_message_s:g}s",
                )
            if refused := await loop.run_in_executor(self._pool, self._take, push, *first):
                return refused
            async for head, data in messages:
                await loop.run_in_executor(self._pool, self._take, push, head, data)
        except KVLayoutError as e:
            push.status, push.text = Status.REJECTED, str(e)
        finally:  # a stream that ends without its END: the sender died, or gave up
            if push.key is not None and not push.ended:
                self._pool.submit(
                    self.link_lost, push.link, push.src, "the stream ended before its END"
                )
        return pb.PushAck(status=push.status.name, message=push.text)

    def _take(self, push: _Push, head: pb.KVChunk, data: memoryview) -> pb.PushAck | None:
        """One message of ``push`` (on a worker thread): the refusal that ends the stream
        when it is a first message that does not open a push, else None."""
        if push.key is None:
            if problem := self._unproven(head, push.sender):
                return self._refuse(push.link.peer, problem)
            push.key, push.layout = (
                transfer_key(head.transfer_id),
                KVLayout.from_proto(head.src_layout),
            )
            push.src = push.layout.tp_rank
        for meta in head.meta:
            self._segment(push.key, push.src, push.layout, meta, data, push.link)
        if head.end:
            push.status, push.text = self.end(push.key, push.src, head.handoff, push.link)
            push.ended = True
        return None

    def _unproven(self, head: pb.KVChunk, sender: str) -> str:
        """Why a stream's first message does not open a push ("" when it does)."""
        if not 0 < len(head.transfer_id) <= MAX_TOKEN or len(head.nonce) != auth.NONCE_BYTES:
            return "the first message names no transfer token and nonce"
        if head.sender != sender:
            return f"the first message names sender {head.sender!r}, the stream {sender!r}"
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
        stop = asyncio.run_coroutine_threadsafe(self._server.stop(None), self._loop)
        try:
            stop.result(5)
        finally:
            self._stop_loop()
            self._pool.shutdown(wait=False)

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self._loop.close()
