"""Device caches: skipped without CUDA (CI); run where a GPU is lent.

grpc moves CUDA caches through host bytes (gather on the device, copy out, copy in,
scatter on the device). nccl needs two GPUs (NCCL refuses two ranks on one device),
one per process.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from pdserve.kv_transfer import KVDestination, get_transport
from pdserve.kv_transfer.routes import routes_into
from tests.kv_transfer.helpers import SECRET, Peer, layout, reference, shard

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

NUM_BLOCKS = 16
SRC_IDS = [3, 4, 5, 6, 7, 1, 12]
DST_IDS = [8, 9, 10, 11, 12, 0, 5]


@pytest.mark.parametrize("src_tp, dst_tp", list(itertools.product((1, 2, 4), repeat=2)))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grpc_between_device_caches(src_tp, dst_tp, dtype):
    tr = get_transport("grpc")
    full = reference(layout(dtype=dtype), NUM_BLOCKS, 5).cuda()
    dl = [layout(dst_tp, r, dtype=dtype) for r in range(dst_tp)]
    caches = [torch.zeros(lay.cache_shape(NUM_BLOCKS), dtype=lay.torch_dtype).cuda() for lay in dl]
    receivers = [tr.receiver(lay, c, secret=SECRET) for lay, c in zip(dl, caches, strict=True)]
    senders = [
        tr.sender(layout(src_tp, r, dtype=dtype), secret=SECRET, checksum=True)
        for r in range(src_tp)
    ]
    try:
        dst = KVDestination([r.address for r in receivers], DST_IDS, dl[0], "grpc", "t")
        for r in receivers:
            r.expect("t", DST_IDS, layout(src_tp, dtype=dtype), lease_s=30, token="t")
        for s in senders:
            s.send_all("t", shard(full, s.layout), SRC_IDS, dst)
        for s in senders:
            assert all(a.status.name == "OK" for a in s.finish("t", timeout=30).acks)
        for lay, r, c in zip(dl, receivers, caches, strict=True):
            r.wait("t", timeout=30)
            assert torch.equal(c[:, :, DST_IDS], shard(full, lay)[:, :, SRC_IDS])
    finally:
        for x in senders + receivers:
            x.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="nccl needs two GPUs")
def test_nccl_across_processes():
    tr = get_transport("nccl")
    torch.cuda.set_device(0)
    cache = torch.zeros(layout().cache_shape(NUM_BLOCKS), device="cuda:0")
    receiver = tr.receiver(layout(), cache, secret=SECRET)
    peer = Peer()
    try:
        reply = peer.ask(op="senders", key="n", backend="nccl", tp=1, name="gpu1",
                         checksum=True, layers=3, device="cuda:1")  # fmt: skip
        assert reply["ok"], reply
        token = receiver.expect("t", DST_IDS, layout(), lease_s=60)
        dst = KVDestination([receiver.address], DST_IDS, layout(), "nccl", token)
        reply = peer.ask(op="send", key="n", tid="t", seed=9, num_blocks=NUM_BLOCKS,
                         src_ids=SRC_IDS, dst=dst.to_proto().SerializeToString().hex(),
                         device="cuda:1")  # fmt: skip
        assert reply["ok"], reply
        receiver.wait("t", timeout=60)
        full = reference(layout(), NUM_BLOCKS, 9)
        assert torch.equal(cache[:, :, DST_IDS].cpu(), full[:, :, SRC_IDS])
    finally:
        peer.close()
        receiver.close()


def _latent_round_trip(device: str, spec: dict, dtype: str, src_tp: int, dst_tp: int) -> None:
    """A latent cache (``spec``, tests/kv_transfer/helpers.py's ``layout``) over grpc
    between ``device`` caches: byte-exact rows, the bytes equal to the layout's formula."""
    tr = get_transport("grpc")

    def lat(tp=1, r=0):
        return layout(tp, r, dtype=dtype, latent=spec)

    full = reference(lat(), NUM_BLOCKS, 6).to(device)
    dl = [lat(dst_tp, r) for r in range(dst_tp)]
    caches = [torch.zeros(x.cache_shape(NUM_BLOCKS), dtype=x.torch_dtype, device=device)
              for x in dl]  # fmt: skip
    receivers = [tr.receiver(x, c, secret=SECRET) for x, c in zip(dl, caches, strict=True)]
    senders = [tr.sender(lat(src_tp, r), secret=SECRET, checksum=True) for r in range(src_tp)]
    try:
        dst = KVDestination([r.address for r in receivers], DST_IDS, dl[0], "grpc", "t")
        wired = [r for r, x in zip(receivers, dl, strict=True) if routes_into(x, src_tp)]
        for r in wired:  # a replicated row: decode rank 0 alone (the instance forwards it)
            r.expect("t", DST_IDS, lat(src_tp), lease_s=30, token="t")
        for s in senders:
            s.send_all("t", shard(full, s.layout), SRC_IDS, dst)
        sent = sum(s.finish("t", timeout=30).bytes for s in senders)
        landed = sum(r.wait("t", timeout=30).bytes for r in wired)
        assert sent == landed == lat().transfer_bytes(len(SRC_IDS), dst_tp)
        for r, x, c in zip(receivers, dl, caches, strict=True):
            want = shard(full, x)[:, SRC_IDS] if r in wired else torch.zeros_like(c[:, DST_IDS])
            assert torch.equal(c[:, DST_IDS], want)
    finally:
        for x in senders + receivers:
            x.close()


@pytest.mark.parametrize("src_tp, dst_tp", list(itertools.product((1, 2), repeat=2)))
@pytest.mark.parametrize("replicated", [True, False], ids=["mla", "gla2"])
def test_grpc_between_device_latent_caches(src_tp, dst_tp, replicated):
    spec = {"heads": 1 if replicated else 2, "dim": 32, "rope": 8, "replicated": replicated}
    _latent_round_trip("cuda", spec, "bfloat16", src_tp, dst_tp)
