"""Integrity and failure handling over real transports: checksums on, a corrupted chunk
caught, a sender that dies or stalls midway (the receiver fails or times out cleanly
and takes the next transfer), the lease (from the first byte, renewed by progress),
pairs rebuilt after either side restarts (gloo). tests/kv_transfer/test_handoff.py
walks every state of the handoff under every fault."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from pdserve.kv_transfer import (
    KVChecksumError,
    KVDestination,
    KVLayoutError,
    KVPeerError,
    KVTransferError,
    KVTransferTimeout,
    State,
    get_transport,
)
from tests.kv_transfer.faults import ENV, write_plan
from tests.kv_transfer.helpers import SECRET, Peer, layout, reference, shard, tokened

NUM_BLOCKS = 16
SRC_IDS = [3, 4, 5, 6, 7, 1, 12]
DST_IDS = [8, 9, 10, 11, 12, 0, 5]
BACKENDS = ["gloo", "grpc"]


class Side:
    """Decode-side receivers (here) for one backend, with their caches."""

    def __init__(self, backend: str, tp: int = 1, **options):
        self.backend = backend
        tr = get_transport(backend)
        self.caches = [torch.zeros(layout(tp, r).cache_shape(NUM_BLOCKS)) for r in range(tp)]
        self.receivers = [
            tr.receiver(layout(tp, r), c, secret=SECRET, **options)
            for r, c in enumerate(self.caches)
        ]
        self.base = KVDestination([r.address for r in self.receivers], DST_IDS, layout(tp), backend)

    def dst(self, tid: str) -> KVDestination:
        return tokened(self.base, tid)

    def expect(self, tid: str, src_tp: int = 1, lease_s: float = 30.0) -> None:
        for r in self.receivers:
            r.expect(tid, DST_IDS, layout(src_tp), lease_s=lease_s, token=tid)

    def check(self, seed: int) -> None:
        full = reference(layout(), NUM_BLOCKS, seed)
        for rank, cache in enumerate(self.caches):
            want = shard(full, self.receivers[rank].layout)[:, :, SRC_IDS]
            assert torch.equal(cache[:, :, DST_IDS], want)

    def close(self) -> None:
        for r in self.receivers:
            r.close()


@pytest.fixture(params=BACKENDS)
def side(request):
    s = Side(request.param)
    yield s
    s.close()


def _senders(peer: Peer, side: Side, name: str, **options) -> str:
    key = f"{side.backend}-{name}"
    reply = peer.ask(op="senders", key=key, backend=side.backend, tp=1, name=name,
                     checksum=True, layers=3, **options)  # fmt: skip
    assert reply["ok"], reply
    return key


def _send(peer: Peer, side: Side, key: str, tid: str, seed: int, **kw) -> dict:
    dst = side.dst(tid).to_proto().SerializeToString().hex()
    return peer.ask(op="send", key=key, tid=tid, seed=seed, num_blocks=NUM_BLOCKS,
                    src_ids=SRC_IDS, dst=dst, **kw)  # fmt: skip


def test_round_trip_with_checksums(peer, side):
    key = _senders(peer, side, "roundtrip")
    for i, seed in enumerate((11, 12)):  # the second reuses the pair / channel
        side.expect(f"rt-{i}")
        reply = _send(peer, side, key, f"rt-{i}", seed)
        assert reply["ok"] and reply["acks"] == [["OK"]], reply
        outcome = side.receivers[0].wait(f"rt-{i}", timeout=20)
        assert outcome.state == State.LANDED and outcome.handoff.first_token == seed
        assert outcome.bytes == 2 * 3 * len(SRC_IDS) * layout().block_bytes()
        side.check(seed)


@pytest.mark.parametrize("backend", BACKENDS)
def test_corrupted_chunk_is_caught(backend, tmp_path, monkeypatch):
    """The test transport makes one segment's checksum differ from its bytes: the
    receiver fails the transfer naming the segment, the sender's END is answered
    CHECKSUM, and the next transfer on the same pair lands."""
    monkeypatch.setenv(ENV, str(tmp_path / "plan.json"))
    write_plan(tmp_path / "plan.json", [{"side": "sender", "step": "data", "action": "corrupt",
                                         "match": "bad"}])  # fmt: skip
    side = Side(backend)
    sender = get_transport(f"tests.kv_transfer.faults:{backend}").sender(
        layout(), secret=SECRET, checksum=True
    )
    cache = shard(reference(layout(), NUM_BLOCKS, 21), layout())
    try:
        side.expect("bad")
        sender.send_all("bad", cache, SRC_IDS, side.dst("bad"))
        with pytest.raises(KVChecksumError, match="CHECKSUM"):
            sender.finish("bad", timeout=10)
        with pytest.raises(KVChecksumError, match=r"'bad'.*checksum mismatch in layer 0"):
            side.receivers[0].wait("bad", timeout=10)
        assert side.receivers[0].pending() == []
        side.expect("good")
        sender.send_all("good", cache, SRC_IDS, side.dst("good"))
        sender.finish("good", timeout=10)
        side.receivers[0].wait("good", timeout=20)
        side.check(21)
    finally:
        sender.close()
        side.close()


def test_sender_that_stalls_midway_times_out_cleanly(peer, side):
    key = _senders(peer, side, "stall")
    side.expect("half")
    reply = _send(peer, side, key, "half", seed=31, send_layers=[0, 2], finish=False)
    assert reply["ok"], reply
    t = time.monotonic()
    with pytest.raises(KVTransferTimeout, match=r"'half'.*missing layers 1 from source rank 0"):
        side.receivers[0].wait("half", timeout=1.0)
    assert time.monotonic() - t < 5
    assert side.receivers[0].pending() == []
    side.expect("next")
    reply = _send(peer, side, key, "next", seed=32)
    assert reply["ok"], reply
    side.receivers[0].wait("next", timeout=20)
    side.check(32)


def test_sender_that_dies_midway_then_restarts(side):
    """The sender process dies after some layers: the receiver fails the transfer as
    soon as the connection drops (not at its lease), nothing stays registered; a
    restarted sender (same name, new process) transfers again: for gloo, over a rebuilt
    pair group (a new generation)."""
    first = Peer()
    try:
        key = _senders(first, side, "phoenix")
        side.expect("doomed")
        with pytest.raises(RuntimeError, match="peer process exited"):
            _send(first, side, key, "doomed", seed=41, send_layers=[0], die_after_s=0.3)
    finally:
        first.kill()
    with pytest.raises(KVPeerError, match=r"'doomed'.*connection lost"):
        side.receivers[0].wait("doomed", timeout=10.0)
    assert side.receivers[0].pending() == []
    second = Peer()
    try:
        key = _senders(second, side, "phoenix")
        side.expect("reborn")
        reply = _send(second, side, key, "reborn", seed=42)
        assert reply["ok"], reply
        side.receivers[0].wait("reborn", timeout=20)
        side.check(42)
        if side.backend == "gloo":
            assert side.receivers[0].generations[("phoenix", 0)] == 2
    finally:
        second.close()


def test_lease_runs_from_the_first_byte_and_late_bytes_never_land(peer, side):
    """A reservation nothing was sent to has no timer (the prefill may be queued); once
    bytes flow, no progress for ``lease_s`` expires it; after its release the rest of the
    transfer is refused and no byte lands in its blocks."""
    key = _senders(peer, side, "late")
    receiver, events = side.receivers[0], []
    receiver.on_event = events.append
    side.expect("queued", lease_s=0.2)
    time.sleep(0.5)
    assert receiver.state("queued") == State.RESERVED
    assert _send(peer, side, key, "queued", seed=50)["ok"]
    assert receiver.wait("queued", timeout=20).state == State.LANDED
    side.expect("stalled", lease_s=0.3)
    assert _send(peer, side, key, "stalled", seed=51, send_layers=[0], finish=False)["ok"]
    deadline = time.monotonic() + 10
    while receiver.state("stalled") != State.EXPIRED and time.monotonic() < deadline:
        time.sleep(0.02)
    assert receiver.state("stalled") == State.EXPIRED
    assert [e.state for e in events] == [State.LANDED, State.EXPIRED]
    assert "made no progress for 0.3s" in str(events[-1].error)
    receiver.release("stalled")
    side.caches[0].zero_()
    reply = _send(peer, side, key, "stalled", seed=51, send_layers=[1, 2])
    assert not reply["ok"] and "UNKNOWN" in reply["error"], reply
    assert not side.caches[0].any(), "bytes landed in released blocks"
    with pytest.raises(KVTransferError, match="not expected here"):
        receiver.wait("stalled", timeout=1)


def test_gloo_receives_straight_into_the_cache():
    """Runs sent on their own whatever their size (``pack_below=0``): the contiguous run
    lands without staging (tp 1 -> 1, all heads), the head-split ranks (1 -> 2) through
    staging; the strays come packed."""
    tr = get_transport("gloo")
    full = reference(layout(), NUM_BLOCKS, 61)
    for dst_tp in (1, 2):
        side = Side("gloo", tp=dst_tp)
        sender = tr.sender(layout(), secret=SECRET, checksum=True, pack_below=0)
        try:
            side.expect("direct")
            sender.send_all("direct", shard(full, layout()), SRC_IDS, side.dst("direct"))
            assert [a.status.name for a in sender.finish("direct").acks] == ["OK"] * dst_tp
            for r in side.receivers:
                r.wait("direct", timeout=20)
            side.check(61)
        finally:
            sender.close()
            side.close()


@pytest.mark.parametrize("dst_tp, pack_below", [(1, 0), (2, 0), (1, 1 << 20), (2, 1 << 20)])
def test_gloo_layer_by_layer(dst_tp, pack_below):
    """``send_layer`` once per layer, in any order, as the forward pass does (layer-wise):
    bit-exact with checksums, runs sent on their own or packed."""
    tr = get_transport("gloo")
    cache = shard(reference(layout(), NUM_BLOCKS, 91), layout())
    side = Side("gloo", tp=dst_tp)
    sender = tr.sender(layout(), secret=SECRET, checksum=True, pack_below=pack_below)
    try:
        side.expect("layerwise")
        for layer in (2, 0, 1):
            k, v = cache[layer, 0], cache[layer, 1]
            sender.send_layer("layerwise", layer, k, v, SRC_IDS, side.dst("layerwise"))
        assert [a.status.name for a in sender.finish("layerwise").acks] == ["OK"] * dst_tp
        for r in side.receivers:
            assert r.wait("layerwise", timeout=20).bytes == 2 * 3 * len(SRC_IDS) * (
                r.layout.block_bytes()
            )
        side.check(91)
    finally:
        sender.close()
        side.close()


@pytest.mark.parametrize("verify_idle_s", [0.0, 600.0])
def test_gloo_pair_rebuilt_after_the_receiver_restarts(verify_idle_s):
    """The receiver process restarts on the same address: the sender (here) forms a new
    pair on its next transfer, having asked the store for the receiver's incarnation
    (the pair was idle) or found the old pair closed on its first send (recently used)."""
    tr = get_transport("gloo")
    sender = tr.sender(
        layout(), secret=SECRET, checksum=True, name="steady", verify_idle_s=verify_idle_s
    )
    full = reference(layout(), NUM_BLOCKS, 71)
    cache = shard(full, layout())
    peers = []
    try:
        port = None
        for attempt in range(2):
            peer = Peer()
            peers.append(peer)
            reply = peer.ask(op="receivers", backend="gloo", tp=1, layers=3,
                             num_blocks=NUM_BLOCKS, ports=[port] if port else None)  # fmt: skip
            assert reply["ok"], reply
            address = reply["addresses"][0]
            port = port or int(address.rsplit(":", 1)[1])
            assert address.endswith(f":{port}")
            tid = f"restart-{attempt}"
            assert peer.ask(op="expect", tid=tid, dst_ids=DST_IDS, src_tp=1, layers=3)["ok"]
            dst = KVDestination([address], DST_IDS, layout(), "gloo", tid)
            sender.send_all(tid, cache, SRC_IDS, dst)
            assert sender.finish(tid, timeout=20).acks[0].status.name == "OK"
            assert peer.ask(op="wait", tid=tid, timeout=20)["ok"]
            got = peer.ask(op="digest", rank=0, ids=DST_IDS)["digest"]
            from tests.kv_transfer.peer import tensor_digest

            assert got == tensor_digest(cache[:, :, SRC_IDS])
            if attempt == 0:
                peer.kill()
    finally:
        sender.close()
        for p in peers:
            p.close()


def test_mismatched_block_sizes_are_refused_by_name():
    tr = get_transport("grpc")
    sender = tr.sender(layout(), secret=SECRET)
    try:
        from pdserve.kv_transfer import KVLayout

        other = KVLayout(3, 8, 4, 8)  # block_size 8 against the sender's 4
        dst = KVDestination(["127.0.0.1:1"], DST_IDS, other, "grpc")
        cache = torch.zeros(layout().cache_shape(NUM_BLOCKS))
        with pytest.raises(KVLayoutError, match="block_size=4.*block_size=8"):
            sender.send_all("x", cache, SRC_IDS, dst)
    finally:
        sender.close()


def test_gloo_abort_keeps_the_pair_in_step():
    """A transfer aborted with its messages still on the way: they go anyway (and land:
    the receiver still expects them; without an END it never counts as landed), and the
    next transfer on the same pair lands in its own blocks, bit for bit."""
    tr = get_transport("gloo")
    side = Side("gloo")
    sender = tr.sender(layout(), secret=SECRET, checksum=True, pack_below=0)
    try:
        first, second = reference(layout(), NUM_BLOCKS, 81), reference(layout(), NUM_BLOCKS, 82)
        other_ids = [1, 2, 3, 4, 6, 13, 14]
        for r in side.receivers:
            r.expect("dropped", other_ids, layout(), lease_s=30, token="dropped")
        side.expect("kept")
        dropped = dataclasses.replace(side.dst("dropped"), block_ids=other_ids)
        sender.send_all("dropped", shard(first, layout()), SRC_IDS, dropped)
        sender.abort("dropped")
        sender.send_all("kept", shard(second, layout()), SRC_IDS, side.dst("kept"))
        assert sender.finish("kept", timeout=20).acks[0].status.name == "OK"
        side.receivers[0].wait("kept", timeout=20)
        side.check(82)
        assert side.receivers[0].state("dropped") == State.RECEIVING
        assert torch.equal(side.caches[0][:, :, other_ids], shard(first, layout())[:, :, SRC_IDS])
        side.receivers[0].release("dropped")
    finally:
        sender.close()
        side.close()


def test_gloo_concurrent_finishes_on_one_pair_get_their_own_acks():
    """Several transfers in flight on one pair, finished from as many threads at once
    (the prefill worker's ack threads): each gets its own acknowledgement and lands in
    its own blocks."""
    from concurrent.futures import ThreadPoolExecutor

    tr = get_transport("gloo")
    side = Side("gloo")
    sender = tr.sender(layout(), secret=SECRET, checksum=True)
    src_ids = [3, 4]
    dst_sets = [[2 * i, 2 * i + 1] for i in range(8)]
    caches = [shard(reference(layout(), NUM_BLOCKS, 90 + i), layout()) for i in range(8)]
    try:
        for rounds in range(20):
            tids = [f"t{rounds}-{i}" for i in range(8)]
            for tid, ids, cache in zip(tids, dst_sets, caches, strict=True):
                side.receivers[0].expect(tid, ids, layout(), lease_s=30, token=tid)
                sender.send_all(
                    tid, cache, src_ids, dataclasses.replace(side.dst(tid), block_ids=ids)
                )
            with ThreadPoolExecutor(8) as pool:
                acks = list(pool.map(lambda t: sender.finish(t, timeout=20), tids))
            assert [a.acks[0].status.name for a in acks] == ["OK"] * 8
            for tid, ids, cache in zip(tids, dst_sets, caches, strict=True):
                side.receivers[0].wait(tid, timeout=20)
                assert torch.equal(side.caches[0][:, :, ids], cache[:, :, src_ids])
    finally:
        sender.close()
        side.close()
