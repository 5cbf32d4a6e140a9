"""Acceptance: for every (prefill TP, decode TP) in {1, 2, 4}^2 on a model with 4 KV
heads, the decode ranks' caches assembled from the real transport equal, bit for bit,
the reference cache's head slice for each decode rank, at other block ids than the
source's.

gloo crosses processes: the prefill ranks' senders live in a peer process, the decode
ranks' receivers here. grpc runs the same cross product with both sides here.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from pdserve.kv_transfer import KVDestination, get_transport
from tests.kv_transfer.helpers import SECRET, layout, reference, shard, tokened

COMBOS = list(itertools.product((1, 2, 4), repeat=2))
NUM_BLOCKS = 20
# a run of 5 consecutive source ids landing on a run of 5 destination ids, and strays
SRC_IDS = [9, 2, 3, 4, 5, 6, 11, 0]
DST_IDS = [7, 12, 13, 14, 15, 16, 3, 1]
SEED = 1234


def _receivers(backend: str):
    tr = get_transport(backend)
    out = {}
    for tp in (1, 2, 4):
        caches = [torch.zeros(layout(tp, r).cache_shape(NUM_BLOCKS)) for r in range(tp)]
        out[tp] = (
            [tr.receiver(layout(tp, r), c, secret=SECRET) for r, c in enumerate(caches)],
            caches,
        )
    return out


@pytest.fixture(scope="module")
def gloo_receivers():
    recv = _receivers("gloo")
    yield recv
    for rs, _ in recv.values():
        for r in rs:
            r.close()


@pytest.fixture(scope="module")
def grpc_side():
    recv = _receivers("grpc")
    tr = get_transport("grpc")
    senders = {
        tp: [tr.sender(layout(tp, r), secret=SECRET, checksum=True) for r in range(tp)]
        for tp in (1, 2, 4)
    }
    yield recv, senders
    for rs, _ in recv.values():
        for r in rs:
            r.close()
    for group in senders.values():
        for s in group:
            s.close()


def check(caches, dst_tp: int) -> None:
    full = reference(layout(), NUM_BLOCKS, SEED)
    untouched = [b for b in range(NUM_BLOCKS) if b not in DST_IDS]
    for rank, cache in enumerate(caches):
        expected = shard(full, layout(dst_tp, rank))[:, :, SRC_IDS]
        got = cache[:, :, DST_IDS]
        assert torch.equal(got, expected), f"decode rank {rank} differs"
        assert not cache[:, :, untouched].any(), "bytes landed outside the reserved blocks"


@pytest.mark.parametrize("src_tp, dst_tp", COMBOS)
def test_gloo_across_processes(peer, gloo_receivers, src_tp, dst_tp):
    receivers, caches = gloo_receivers[dst_tp]
    for c in caches:
        c.zero_()
    key = f"gloo-tp{src_tp}"
    reply = peer.ask(op="senders", key=key, backend="gloo", tp=src_tp, name=f"prefill-{src_tp}",
                     checksum=True, layers=3)  # fmt: skip
    assert reply["ok"], reply
    dst = KVDestination([r.address for r in receivers], DST_IDS, layout(dst_tp), "gloo")
    tid = f"hm-{src_tp}-{dst_tp}"
    dst = tokened(dst, tid)
    for r in receivers:
        r.expect(tid, DST_IDS, layout(src_tp), lease_s=30, token=tid)
    # layer-wise, out of order, as a forward pass with a late layer would
    reply = peer.ask(op="send", key=key, tid=tid, seed=SEED, num_blocks=NUM_BLOCKS,
                     src_ids=SRC_IDS, dst=dst.to_proto().SerializeToString().hex(),
                     send_layers=[1, 0, 2])  # fmt: skip
    assert reply["ok"], reply
    assert all(status == "OK" for acks in reply["acks"] for status in acks), reply
    for r in receivers:
        stats = r.wait(tid, timeout=20)
        assert stats.bytes == 2 * 3 * len(SRC_IDS) * r.layout.block_bytes()
    check(caches, dst_tp)
    assert all(r.pending() == [] for r in receivers)


@pytest.mark.parametrize("src_tp, dst_tp", COMBOS)
def test_grpc_in_process(grpc_side, src_tp, dst_tp):
    recv, senders = grpc_side
    receivers, caches = recv[dst_tp]
    for c in caches:
        c.zero_()
    dst = KVDestination([r.address for r in receivers], DST_IDS, layout(dst_tp), "grpc")
    tid = f"hm-{src_tp}-{dst_tp}"
    dst = tokened(dst, tid)
    for r in receivers:
        r.expect(tid, DST_IDS, layout(src_tp), lease_s=30, token=tid)
    full = reference(layout(), NUM_BLOCKS, SEED)
    for s in senders[src_tp]:
        s.send_all(tid, shard(full, s.layout), SRC_IDS, dst)
    for s in senders[src_tp]:
        assert all(a.status.name == "OK" for a in s.finish(tid, timeout=20).acks)
    for r in receivers:
        r.wait(tid, timeout=20)
    check(caches, dst_tp)
