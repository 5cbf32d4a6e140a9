"""A destination that already holds the request's leading blocks (its prefix cache):
``KVDestination.cached_blocks`` travels with it, the sender sends only its table's
blocks past them (``source_blocks``), each into the matching reserved block, and the
held blocks are never written; over gloo across processes and gRPC in this process,
prefill TP 1 -> decode TP 2 and 2 -> 1."""

from __future__ import annotations

import pytest
import torch

from pdserve.kv_transfer import Handoff, KVDestination, KVLayoutError, get_transport
from tests.kv_transfer.helpers import SECRET, layout, reference, shard, tokened

NUM_BLOCKS = 16
TABLE = [4, 5, 6, 7, 8, 9, 1, 2]  # the request's blocks on the prefill side
CACHED = [10, 11, 12]  # the destination already holds the first 3 (shared, cached)
RESERVED = [13, 14, 0, 3, 15]  # and reserved these for the other 5
SEED = 77
SENTINEL = 5.0  # what the held blocks contain: they must keep it
COMBOS = [(1, 2), (2, 1)]


def test_the_destination_round_trips_and_checks_the_table():
    dst = KVDestination(["a:1"], RESERVED, layout(1), "grpc", "t", cached_blocks=len(CACHED))
    back = KVDestination.from_bytes(dst.to_bytes())
    assert back == dst and back.cached_blocks == 3
    assert dst.source_blocks(TABLE) == TABLE[3:]
    with pytest.raises(KVLayoutError, match="8 - 3 must equal 4"):
        KVDestination(["a:1"], RESERVED[:4], layout(1), cached_blocks=3).source_blocks(TABLE)
    with pytest.raises(KVLayoutError, match="cached_blocks=-1"):
        KVDestination(["a:1"], RESERVED, layout(1), cached_blocks=-1)
    h = Handoff(7, {"prefill_end": 1.0}, "prefill-0", cached_tokens=48)
    assert Handoff.from_bytes(h.to_bytes()).cached_tokens == 48


def receivers(backend: str, tp: int):
    caches = [torch.zeros(layout(tp, r).cache_shape(NUM_BLOCKS)) for r in range(tp)]
    for c in caches:
        c[:, :, CACHED] = SENTINEL
    tr = get_transport(backend)
    return [tr.receiver(layout(tp, r), c, secret=SECRET) for r, c in enumerate(caches)], caches


def expect(recvs, dst_tp: int, src_tp: int, tid: str, backend: str) -> KVDestination:
    dst = KVDestination([r.address for r in recvs], RESERVED, layout(dst_tp), backend,
                        cached_blocks=len(CACHED))  # fmt: skip
    for r in recvs:  # the receivers expect the new blocks only
        r.expect(tid, RESERVED, layout(src_tp), lease_s=30, token=tid)
    return tokened(dst, tid)


def check(recvs, caches, tid: str) -> None:
    full = reference(layout(), NUM_BLOCKS, SEED)
    for r, cache in zip(recvs, caches, strict=True):
        landed = r.wait(tid, timeout=20)
        assert landed.bytes == 2 * 3 * len(RESERVED) * r.layout.block_bytes()
        assert torch.equal(cache[:, :, RESERVED], shard(full, r.layout)[:, :, TABLE[3:]])
        assert bool((cache[:, :, CACHED] == SENTINEL).all()), "a held block was written"
        r.close()


@pytest.mark.parametrize("src_tp, dst_tp", COMBOS)
def test_grpc_sends_only_the_blocks_past_the_cached_ones(src_tp, dst_tp):
    tr, tid = get_transport("grpc"), f"cp-grpc-{src_tp}-{dst_tp}"
    recvs, caches = receivers("grpc", dst_tp)
    dst = expect(recvs, dst_tp, src_tp, tid, "grpc")
    full = reference(layout(), NUM_BLOCKS, SEED)
    senders = [tr.sender(layout(src_tp, r), secret=SECRET, checksum=True) for r in range(src_tp)]
    try:
        for s in senders:  # layer by layer, as the forward pass sends
            cache = shard(full, s.layout)
            for layer in range(3):
                k, v = cache[layer].unbind(0)
                s.send_layer(tid, layer, k, v, dst.source_blocks(TABLE), dst)
        for s in senders:
            assert all(a.status.name == "OK" for a in s.finish(tid, timeout=20).acks)
    finally:
        for s in senders:
            s.close()
    check(recvs, caches, tid)


@pytest.mark.parametrize("src_tp, dst_tp", COMBOS)
def test_gloo_sends_only_the_blocks_past_the_cached_ones(peer, src_tp, dst_tp):
    tid, key = f"cp-gloo-{src_tp}-{dst_tp}", f"cp-gloo-tp{src_tp}"
    recvs, caches = receivers("gloo", dst_tp)
    dst = expect(recvs, dst_tp, src_tp, tid, "gloo")
    peer.gloo_send(key, src_tp, tid, dst, dst.source_blocks(TABLE), SEED, NUM_BLOCKS,
                   senders={"name": f"prefill-{src_tp}"}, send_layers=[0, 1, 2])  # fmt: skip
    check(recvs, caches, tid)
