"""Decode side of the ``grpc`` backend: a ``KVTransfer`` server writing each chunk's
segments into the cache as they arrive."""

from __future__ import annotations

import warnings
from concurrent import futures

import grpc
import torch

from kv_transfer.checksum import checksum, combine
from kv_transfer.errors import KVChecksumError, KVPeerError
from kv_transfer.grpc_transport.wire import CHANNEL_OPTIONS, KV_BOTH, decode_chunk
from kv_transfer.handoff import layout_from_proto
from kv_transfer.layout import DTYPES, KVLayout, KVLayoutError
from kv_transfer.pending import Status, transfer_key
from kv_transfer.proto import kv_transfer_pb2 as pb
from kv_transfer.receiver import KVReceiver

# The receiver reads chunk data in place from the (read-only) message bytes; torch warns
# about wrapping a read-only buffer although nothing writes through it.
warnings.filterwarnings("ignore", message="The given buffer is not writable", module=__name__)


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
