"""The ``grpc`` backend's messages: the method, the message limits, and a ``KVChunk``
written with its metadata first and its data last, read back without copying the data."""

from __future__ import annotations

import torch

from kv_transfer.proto import kv_transfer_pb2 as pb

METHOD = "/pdserve.kv_transfer.KVTransfer/Push"
KV_BOTH = 2  # KVChunkMeta.kv: the data holds K then V
MAX_MESSAGE = 64 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.max_receive_message_length", MAX_MESSAGE),
]


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
