"""The bytes a handoff actually moves, measured through the KV transport (the third part
of ``python -m pdserve.bench.kv_bytes``): one request's blocks sent from every prefill rank's
cache to every decode rank's over the ``grpc`` backend on loopback, in this process.

``measure_handoff`` counts both ends: the bytes each prefill rank's ``finish`` reports
handed to the transport (``TransferAck.bytes``) and the bytes each decode rank that a
route reaches reports landed (``Outcome.bytes``; a replicated MLA row reaches decode rank
0 alone, which a decode instance then forwards to its other ranks, off the wire);
``bench.kv_bytes`` puts them beside the layout's figure for the same layers; per-head
K/V and latent caches alike (``KVLayout.kind``).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import torch

from pdserve.kv_transfer import KVDestination, KVLayout, get_transport
from pdserve.kv_transfer.routes import routes_into
from pdserve.planner.model_shape import ModelShape

SECRET = b"pdserve-bench-kv-bytes-loopback-secret"  # this process talks to itself only


@dataclass(frozen=True)
class Measured:
    layers: int
    sent: int  # bytes the prefill ranks handed to the transport
    landed: int  # bytes the decode ranks wrote


def _layout(shape: ModelShape, layers: int, block_size: int, tp: int, rank: int) -> KVLayout:
    lat = shape.latent
    if lat is None:
        return KVLayout(
            layers, block_size, shape.num_kv_heads, shape.head_dim, "bfloat16", tp, rank
        )
    return KVLayout(
        layers,
        block_size,
        lat.heads,
        lat.dim,
        "bfloat16",
        tp,
        rank,
        "latent",
        lat.rope_dim,
        lat.heads == 1,
    )


def measure_handoff(
    shape: ModelShape,
    tokens: int,
    prefill_tp: int,
    decode_tp: int,
    layers: int,
    block_size: int = 16,
    timeout_s: float = 120.0,
) -> Measured:
    """Send ``tokens`` tokens' blocks of ``layers`` layers of ``shape`` (bfloat16, zeros)
    from a prefill instance of ``prefill_tp`` ranks to a decode one of ``decode_tp``."""
    grpc = get_transport("grpc")
    blocks = -(-tokens // block_size)
    ids = list(range(blocks))
    tid = f"kv-bytes-{uuid.uuid4().hex[:8]}"
    src_layout = _layout(shape, layers, block_size, prefill_tp, 0)
    recvs = []
    senders = []
    try:
        for r in range(decode_tp):
            lay = _layout(shape, layers, block_size, decode_tp, r)
            cache = torch.zeros(lay.cache_shape(blocks), dtype=lay.torch_dtype)
            recvs.append(grpc.receiver(lay, cache, secret=SECRET, bind="127.0.0.1"))
        token = recvs[0].expect(tid, ids, src_layout, lease_s=timeout_s)
        wired = [recvs[0], *(r for r in recvs[1:] if routes_into(r.layout, prefill_tp))]
        for r in wired[1:]:
            r.expect(tid, ids, src_layout, lease_s=timeout_s, token=token)
        dst_layout = _layout(shape, layers, block_size, decode_tp, 0)
        addresses = [r.address for r in recvs]
        dst = KVDestination(addresses, ids, dst_layout, "grpc", token=token)
        sent = 0
        for p in range(prefill_tp):
            lay = _layout(shape, layers, block_size, prefill_tp, p)
            senders.append(grpc.sender(lay, secret=SECRET, bind="127.0.0.1"))
            cache = torch.zeros(lay.cache_shape(blocks), dtype=lay.torch_dtype)
            senders[-1].send_all(tid, cache, ids, dst)
        for s in senders:
            sent += s.finish(tid, timeout=timeout_s).bytes
        landed = sum(r.wait(tid, timeout=timeout_s).bytes for r in wired)
    finally:
        for side in (*senders, *recvs):
            side.close()
    return Measured(layers, sent, landed)
