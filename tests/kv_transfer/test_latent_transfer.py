"""Latent caches over the real transports: for a replicated MLA row (bfloat16) and a
GLA-2 row sharded by latent head (float32), prefill TP 1/2 -> decode TP 1/2, each
decode rank's reserved blocks equal, byte for byte, its shard of the reference rows at
the source blocks, nothing else is written, and the bytes the senders report and the
receivers land equal ``KVLayout.transfer_bytes``. A replicated row crosses the wire once,
into decode rank 0 (the other decode ranks receive nothing: the decode instance forwards
it, tests/test_block_copy.py and tests/cluster/test_latent_disagg.py). gloo crosses
processes (the senders in the peer process, layer by layer out of order, whole-row runs
unpacked), grpc runs in this process (whole caches); then a cached prefix (only the
blocks past it move) and a corrupted segment (caught by the checksum) on both backends."""

from __future__ import annotations

import itertools

import pytest
import torch

from pdserve.kv_transfer import (
    KVChecksumError,
    KVDestination,
    KVLayout,
    KVLayoutError,
    get_transport,
)
from pdserve.kv_transfer.routes import routes, routes_into
from tests.kv_transfer.faults import ENV, write_plan
from tests.kv_transfer.helpers import SECRET, layout, reference, shard, tokened

SPECS = {
    "mla": ({"heads": 1, "dim": 16, "rope": 8, "replicated": True}, "bfloat16"),
    "gla2": ({"heads": 2, "dim": 16, "rope": 8, "replicated": False}, "float32"),
}
COMBOS = list(itertools.product((1, 2), repeat=2))
NUM_BLOCKS = 20
# a run of 5 consecutive source ids landing on a run of 5 destination ids, and strays
SRC_IDS = [9, 2, 3, 4, 5, 6, 11, 0]
DST_IDS = [7, 12, 13, 14, 15, 16, 3, 1]
SEED = 4321


def lat(name: str, tp: int = 1, rank: int = 0):
    spec, dtype = SPECS[name]
    return layout(tp, rank, dtype=dtype, latent=spec)


class Decode:
    """A decode pool's receivers (here) for one latent layout, with zeroed caches."""

    def __init__(self, backend: str, name: str, tp: int, fill=None):
        self.backend, self.name, self.tp = backend, name, tp
        tr = get_transport(backend)
        self.layouts = [lat(name, tp, r) for r in range(tp)]
        self.caches = [torch.zeros(x.cache_shape(NUM_BLOCKS), dtype=x.torch_dtype)
                       for x in self.layouts]  # fmt: skip
        for c in self.caches if fill is not None else ():
            c[:, fill[0]] = fill[1]
        self.receivers = [tr.receiver(x, c, secret=SECRET)
                          for x, c in zip(self.layouts, self.caches, strict=True)]  # fmt: skip

    def expect(self, tid: str, src_tp: int, ids=DST_IDS, cached: int = 0) -> KVDestination:
        """Every decode rank that a route reaches expects the transfer (a replicated row:
        rank 0 alone)."""
        self.wired = [r for r, x in zip(self.receivers, self.layouts, strict=True)
                      if routes_into(x, src_tp)]  # fmt: skip
        for r in self.wired:
            r.expect(tid, ids, lat(self.name, src_tp), lease_s=30, token=tid)
        dst = KVDestination([r.address for r in self.receivers], ids, lat(self.name, self.tp),
                            self.backend, cached_blocks=cached)  # fmt: skip
        return tokened(dst, tid)

    def check(self, tid: str, src_ids, dst_ids, sent: int, keep=()) -> None:
        """Landed rows equal the reference's; blocks outside ``dst_ids`` and ``keep`` are
        untouched (zero), and so is every block of a rank no route reaches; ``sent`` (the
        senders' reported bytes) and the landed bytes equal the layout's formula."""
        full = reference(lat(self.name), NUM_BLOCKS, SEED)
        want_bytes = lat(self.name).transfer_bytes(len(src_ids), self.tp)
        landed = [r.wait(tid, timeout=20).bytes for r in self.wired]
        assert sent == sum(landed) == want_bytes, (sent, landed, want_bytes)
        others = [b for b in range(NUM_BLOCKS) if b not in dst_ids and b not in keep]
        for r, lay, cache in zip(self.receivers, self.layouts, self.caches, strict=True):
            if r not in self.wired:
                assert not cache[:, [b for b in range(NUM_BLOCKS) if b not in keep]].any()
                continue
            nbytes = landed[self.wired.index(r)]
            got, want = cache[:, dst_ids], shard(full, lay)[:, src_ids]
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), lay.describe()
            assert not cache[:, others].any(), "bytes landed outside the reserved blocks"
            assert nbytes == lay.num_layers * len(dst_ids) * lay.block_bytes()
        assert all(r.pending() == [] for r in self.receivers)

    def close(self) -> None:
        for r in self.receivers:
            r.close()


def _send_in_peer(peer, name: str, src_tp: int, tid: str, dst, src_ids, layers,
                  **options) -> int:  # fmt: skip
    spec, dtype = SPECS[name]
    key = f"latent-{name}-tp{src_tp}"
    options = {"name": f"prefill-{key}", "latent": spec, "dtype": dtype, **options}
    reply = peer.gloo_send(key, src_tp, tid, dst, src_ids, SEED, NUM_BLOCKS, senders=options,
                           send_layers=layers)  # fmt: skip
    return sum(reply["bytes"])


def _send_here(name: str, src_tp: int, tid: str, dst, src_ids, layerwise: bool) -> int:
    tr, full = get_transport("grpc"), reference(lat(name), NUM_BLOCKS, SEED)
    senders = [tr.sender(lat(name, src_tp, r), secret=SECRET, checksum=True)
               for r in range(src_tp)]  # fmt: skip
    try:
        for s in senders:
            cache = shard(full, s.layout)
            if not layerwise:
                s.send_all(tid, cache, src_ids, dst)
            for layer in range(3) if layerwise else ():
                s.send_latent_layer(tid, layer, cache[layer], src_ids, dst)
        acks = [s.finish(tid, timeout=20) for s in senders]
    finally:
        for s in senders:
            s.close()
    assert all(a.status.name == "OK" for ack in acks for a in ack.acks)
    return sum(ack.bytes for ack in acks)


@pytest.mark.parametrize("src_tp, dst_tp", COMBOS)
@pytest.mark.parametrize("name", list(SPECS))
def test_gloo_latent_across_processes(peer, name, src_tp, dst_tp):
    side, tid = Decode("gloo", name, dst_tp), f"lat-gloo-{name}-{src_tp}-{dst_tp}"
    try:
        dst = side.expect(tid, src_tp)
        # every run of whole rows (MLA) straight from the cache into the cache, unpacked
        sent = _send_in_peer(peer, name, src_tp, tid, dst, SRC_IDS, [1, 0, 2], pack_below=0)
        side.check(tid, SRC_IDS, DST_IDS, sent)
    finally:
        side.close()


@pytest.mark.parametrize("src_tp, dst_tp", COMBOS)
@pytest.mark.parametrize("name", list(SPECS))
def test_grpc_latent_in_process(name, src_tp, dst_tp):
    side, tid = Decode("grpc", name, dst_tp), f"lat-grpc-{name}-{src_tp}-{dst_tp}"
    try:
        dst = side.expect(tid, src_tp)
        sent = _send_here(name, src_tp, tid, dst, SRC_IDS, layerwise=False)
        side.check(tid, SRC_IDS, DST_IDS, sent)
    finally:
        side.close()


TABLE = [4, 5, 6, 7, 8, 9, 1, 2]  # the request's blocks on the prefill side
CACHED = [10, 11, 12]  # the destination already holds the first 3
RESERVED = [13, 14, 0, 3, 15]  # and reserved these for the other 5
SENTINEL = 5.0


@pytest.mark.parametrize("backend", ["gloo", "grpc"])
@pytest.mark.parametrize("name, src_tp, dst_tp", [("mla", 1, 2), ("gla2", 2, 1)])
def test_latent_cached_prefix_sends_only_the_rest(peer, backend, name, src_tp, dst_tp):
    side = Decode(backend, name, dst_tp, fill=(CACHED, SENTINEL))
    tid = f"lat-cp-{backend}-{name}-{src_tp}-{dst_tp}"
    try:
        dst = side.expect(tid, src_tp, RESERVED, cached=len(CACHED))
        src_ids = dst.source_blocks(TABLE)
        if backend == "gloo":  # whole caches from the peer process
            sent = _send_in_peer(peer, name, src_tp, tid, dst, src_ids, None)
        else:  # layer by layer, as the forward pass sends
            sent = _send_here(name, src_tp, tid, dst, src_ids, layerwise=True)
        side.check(tid, TABLE[3:], RESERVED, sent, keep=CACHED)
        assert all(bool((c[:, CACHED] == SENTINEL).all()) for c in side.caches)
    finally:
        side.close()


@pytest.mark.parametrize("backend", ["gloo", "grpc"])
def test_latent_corrupted_segment_is_caught(backend, tmp_path, monkeypatch):
    """One segment's checksum differs from its bytes: the receiver fails the transfer
    naming the segment, the END is answered CHECKSUM; the next transfer lands."""
    monkeypatch.setenv(ENV, str(tmp_path / "plan.json"))
    write_plan(tmp_path / "plan.json", [{"side": "sender", "step": "data", "action": "corrupt",
                                         "match": "bad"}])  # fmt: skip
    side = Decode(backend, "gla2", 2)
    sender = get_transport(f"tests.kv_transfer.faults:{backend}").sender(
        lat("gla2"), secret=SECRET, checksum=True
    )
    cache = shard(reference(lat("gla2"), NUM_BLOCKS, SEED), lat("gla2"))
    try:
        sender.send_all("bad", cache, SRC_IDS, side.expect("bad", 1))
        with pytest.raises(KVChecksumError, match="CHECKSUM"):
            sender.finish("bad", timeout=10)
        errors = []
        for r in side.receivers:
            try:
                r.wait("bad", timeout=10)
            except KVChecksumError as e:
                errors.append(str(e))
        assert len(errors) == 1 and "checksum mismatch in layer 0" in errors[0], errors
        sender.send_all("good", cache, SRC_IDS, side.expect("good", 1))
        sent = sender.finish("good", timeout=10).bytes
        side.check("good", SRC_IDS, DST_IDS, sent)
    finally:
        sender.close()
        side.close()


def test_sending_a_layer_of_the_other_kind_is_refused():
    tr = get_transport("grpc")
    latent, kv = tr.sender(lat("gla2"), secret=SECRET), tr.sender(layout(), secret=SECRET)
    dst = KVDestination(["127.0.0.1:1"], [0], lat("gla2"), "grpc", "t")
    row = torch.zeros(lat("gla2").cache_shape(4))[0]
    try:
        with pytest.raises(KVLayoutError, match="'latent' layout sends 1 per layer"):
            latent.send_layer("t", 0, row, row, [1], dst)
        with pytest.raises(KVLayoutError, match=r"is \(4, 4, 41\).*\['blocks', 4, 40\]"):
            latent.send_latent_layer("t", 0, torch.zeros(4, 4, 41), [1], dst)
        with pytest.raises(KVLayoutError, match="'kv' layout sends 2 per layer"):
            kv.send_latent_layer("t", 0, row, [1], dst)
    finally:
        latent.close()
        kv.close()


@pytest.mark.parametrize("backend", ["gloo", "grpc"])
@pytest.mark.parametrize(
    "spec, src_tp, dst_tp",
    [
        ({"heads": 1, "dim": 512, "rope": 64, "replicated": True}, 1, 2),  # DeepSeek-V3's row
        ({"heads": 2, "dim": 256, "rope": 64, "replicated": False}, 2, 2),  # GLA-2, 256 wide
    ],
    ids=["mla-512", "gla2-256"],
)
def test_full_size_rows_split_into_many_segments(backend, spec, src_tp, dst_tp):
    """Rows of real widths in bfloat16, blocks of 16, 60 blocks (a run of 40, 20 strays):
    the segments are cut at the transport's part limits (gRPC's 512 KiB cuts the run),
    and still land byte for byte, the bytes equal to the formula."""
    tr, blocks, bs = get_transport(backend), 80, 16
    lays = {(tp, r): KVLayout(2, bs, spec["heads"], spec["dim"], "bfloat16", tp, r, "latent",
                              spec["rope"], spec["replicated"])
            for tp in {src_tp, dst_tp} for r in range(tp)}  # fmt: skip
    src_ids = list(range(3, 43)) + list(range(79, 59, -1))
    dst_ids = list(range(20, 80))
    g = torch.Generator().manual_seed(9)
    full = torch.randn(2, blocks, bs, lays[src_tp, 0].units, generator=g).to(torch.bfloat16)
    dst_lays = [lays[dst_tp, r] for r in range(dst_tp)]
    caches = [torch.zeros(x.cache_shape(blocks), dtype=torch.bfloat16) for x in dst_lays]
    receivers = [tr.receiver(x, c, secret=SECRET) for x, c in zip(dst_lays, caches, strict=True)]
    senders = [tr.sender(lays[src_tp, r], secret=SECRET, checksum=True) for r in range(src_tp)]
    try:
        dst = KVDestination([r.address for r in receivers], dst_ids, dst_lays[0], backend, "big")
        wired = [r for r, x in zip(receivers, dst_lays, strict=True) if routes_into(x, src_tp)]
        for r in wired:  # MLA: decode rank 0 alone
            r.expect("big", dst_ids, lays[src_tp, 0], lease_s=30, token="big")
        for s in senders:
            s.send_all("big", shard(full, s.layout), src_ids, dst)
        acks = [s.finish("big", timeout=60) for s in senders]
        landed = [r.wait("big", timeout=60).bytes for r in wired]
        assert sum(a.bytes for a in acks) == sum(landed)
        assert sum(landed) == dst_lays[0].transfer_bytes(len(src_ids), dst_tp)
        assert sum(a.segments for a in acks) > 2 * len(routes(dst_lays[0], src_tp, dst_tp))
        for r, x, c in zip(receivers, dst_lays, caches, strict=True):
            if r not in wired:  # nothing over the wire (the decode instance forwards it)
                assert not c.any()
                continue
            want = shard(full, x)[:, src_ids]
            assert torch.equal(c[:, dst_ids].view(torch.int16), want.view(torch.int16))
            assert not c[:, :20].any()
    finally:
        for x in senders + receivers:
            x.close()
