"""Per-layer skips (``KVDestination.layer_skip``, docs/kv_transfer.md "Sliding windows"):
a sliding layer of a model with global layers too receives only the blocks inside its
window. The field round-trips and is checked; the sender sends layer ``l`` the blocks
``[layer_skip[l], n)`` only, over gRPC (layer by layer, and all at once) in this process
and gloo from a peer process, prefill TP 1 -> decode TP 2 and 2 -> 1; the bytes both
sides count equal ``KVLayout.transfer_bytes`` exactly, the skipped blocks are never
written; a transfer that lacks a layer's in-window block fails, and a segment for a
skipped block is refused."""

from __future__ import annotations

import pytest
import torch

from pdserve.kv_transfer import KVDestination, KVLayoutError, KVTransferError, Status, get_transport
from pdserve.kv_transfer.segment import Segment, plan_segments
from tests.kv_transfer.helpers import SECRET, layout, reference, shard, tokened

NUM_BLOCKS = 16
TABLE = [4, 5, 6, 7, 8, 1, 2]  # the request's blocks on the prefill side
RESERVED = [9, 10, 11, 0, 3, 12, 13]  # where they land
SKIP = (4, 0, 2)  # layer 0 slides (window in blocks 4..), layer 1 is global, layer 2 slides
SEED = 31
SENTINEL = 5.0  # the reserved blocks' content before the transfer: skipped ones keep it
COMBOS = [(1, 2), (2, 1)]


def test_the_field_round_trips_and_is_checked():
    dst = KVDestination(["a:1"], RESERVED, layout(1), "grpc", "t", layer_skip=SKIP)
    back = KVDestination.from_bytes(dst.to_bytes())
    assert back == dst and back.layer_skip == SKIP and back.skip(0) == 4
    plain = KVDestination(["a:1"], RESERVED, layout(1))
    assert KVDestination.from_bytes(plain.to_bytes()).layer_skip == () and plain.skip(2) == 0
    with pytest.raises(KVLayoutError, match="layer_skip has 2 entries for 3 layers"):
        KVDestination(["a:1"], RESERVED, layout(1), layer_skip=(1, 0))
    with pytest.raises(KVLayoutError, match=r"layer_skip\[2\]=7: allowed \[0, 7\)"):
        KVDestination(["a:1"], RESERVED, layout(1), layer_skip=(0, 0, 7))
    with pytest.raises(KVLayoutError, match=r"layer_skip\[0\]=-1"):
        KVDestination(["a:1"], RESERVED, layout(1), layer_skip=(-1, 0, 0))
    recv = get_transport("grpc").receiver(layout(1), torch.zeros(layout(1).cache_shape(16)),
                                          secret=SECRET)  # fmt: skip
    try:
        with pytest.raises(KVLayoutError, match="layer_skip has 1 entries"):
            recv.expect("x", RESERVED, layout(1), layer_skip=(1,))
    finally:
        recv.close()


def test_the_plan_gives_each_layer_its_window():
    ids = [4, 5, 6, 7, 8, 1, 2]
    skips = {0: 4, 1: 0, 2: 2}
    segs = plan_segments(ids, 0, skips, (0, 4), max_blocks=64, min_run=2)
    for layer, skip in skips.items():
        got = sorted(p for s in segs if s.layer == layer for p in range(s.start, s.start + s.count))
        assert got == list(range(skip, len(ids))), (layer, segs)
    # from the last cut on, every layer's segments are alike: consecutive layers pack
    assert [s for s in segs if s.start >= 4] == [Segment(n, 4, 1, (0, 4)) for n in (0, 1, 2)] + [
        Segment(n, 5, 2, (0, 4)) for n in (0, 1, 2)
    ]
    # a call at an offset (a layer-wise send of part of the list) keeps the positions
    late = plan_segments(ids[3:], 3, skips, (0, 4), max_blocks=64)
    assert {(s.layer, s.start) for s in late if s.start == 3} == {(1, 3), (2, 3)}


def receivers(backend: str, tp: int):
    caches = [torch.full(layout(tp, r).cache_shape(NUM_BLOCKS), SENTINEL) for r in range(tp)]
    tr = get_transport(backend)
    return [tr.receiver(layout(tp, r), c, secret=SECRET) for r, c in enumerate(caches)], caches


def expect(recvs, dst_tp: int, src_tp: int, tid: str, backend: str, skip=SKIP):
    dst = KVDestination([r.address for r in recvs], RESERVED, layout(dst_tp), backend,
                        layer_skip=SKIP)  # fmt: skip
    for r in recvs:
        r.expect(tid, RESERVED, layout(src_tp), lease_s=30, token=tid, layer_skip=skip)
    return tokened(dst, tid)


def check(recvs, caches, tid: str, sent: int) -> None:
    """Each layer's in-window blocks hold the prefill's KV, its skipped ones the sentinel;
    the bytes sent and landed equal the formula."""
    full = reference(layout(), NUM_BLOCKS, SEED)
    want = layout(len(recvs)).transfer_bytes(len(RESERVED), len(recvs), SKIP)
    assert want == 2 * (3 * len(RESERVED) - sum(SKIP)) * layout(1).block_bytes()
    landed = 0
    for r, cache in zip(recvs, caches, strict=True):
        landed += r.wait(tid, timeout=20).bytes
        src = shard(full, r.layout)
        for layer, skip in enumerate(SKIP):
            got = cache[layer][:, RESERVED[skip:]]
            assert torch.equal(got, src[layer][:, TABLE[skip:]]), layer
            assert bool((cache[layer][:, RESERVED[:skip]] == SENTINEL).all()), layer
        r.close()
    assert sent == landed == want


def senders(tr, src_tp: int):
    return [tr.sender(layout(src_tp, r), secret=SECRET, checksum=True) for r in range(src_tp)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("layerwise", [True, False], ids=["layerwise", "all"])
@pytest.mark.parametrize("src_tp, dst_tp", COMBOS)
def test_grpc_sends_each_layer_its_window(src_tp, dst_tp, layerwise):
    tr, tid = get_transport("grpc"), f"ls-grpc-{src_tp}-{dst_tp}-{layerwise}"
    recvs, caches = receivers("grpc", dst_tp)
    dst = expect(recvs, dst_tp, src_tp, tid, "grpc")
    full = reference(layout(), NUM_BLOCKS, SEED)
    out, sent = senders(tr, src_tp), 0
    try:
        for s in out:
            cache = shard(full, s.layout)
            if not layerwise:
                s.send_all(tid, cache, TABLE, dst)
            for layer in range(3) if layerwise else ():
                k, v = cache[layer].unbind(0)
                s.send_layer(tid, layer, k, v, TABLE, dst)
        for s in out:
            ack = s.finish(tid, timeout=20)
            assert all(a.status == Status.OK for a in ack.acks)
            sent += ack.bytes
    finally:
        for s in out:
            s.close()
    check(recvs, caches, tid, sent)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("src_tp, dst_tp", COMBOS)
def test_gloo_sends_each_layer_its_window(peer, src_tp, dst_tp):
    tid, key = f"ls-gloo-{src_tp}-{dst_tp}", f"ls-gloo-tp{src_tp}"
    recvs, caches = receivers("gloo", dst_tp)
    dst = expect(recvs, dst_tp, src_tp, tid, "gloo")
    reply = peer.gloo_send(key, src_tp, tid, dst, TABLE, SEED, NUM_BLOCKS,
                           senders={"name": f"prefill-{src_tp}"})  # fmt: skip
    check(recvs, caches, tid, sum(reply["bytes"]))


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "expected, why",
    [((4, 0, 3), "of layer 2: that layer receives blocks \\[3, 7\\) only"),  # block 2 comes
     ((4, 0, 1), "layers 2 from source rank 0 missing")],  # block 1 never comes
    ids=["extra-segment", "missing-block"],
)  # fmt: skip
def test_a_sender_that_disagrees_fails_the_transfer(expected, why):
    """The sender obeys its destination's ``layer_skip`` (2 for layer 2); a receiver that
    expects another refuses the extra segment, or finds the block missing at the END."""
    tr, tid = get_transport("grpc"), f"ls-bad-{expected[2]}"
    recvs, caches = receivers("grpc", 1)
    dst = expect(recvs, 1, 1, tid, "grpc", skip=expected)
    s = tr.sender(layout(1), secret=SECRET, checksum=True)
    try:
        s.send_all(tid, reference(layout(), NUM_BLOCKS, SEED), TABLE, dst)
        with pytest.raises(KVTransferError, match=why):
            s.finish(tid, timeout=20)
        with pytest.raises(KVTransferError, match=why):
            recvs[0].wait(tid, timeout=20)
    finally:
        s.close()
        recvs[0].close()
