"""The KV plane closed by default (docs/kv_transfer.md, "Closed by default"): the
handshake proofs (a wrong secret refused, a replay refused, a proof bound to its
receiver and its transfer), the header bounds (checked before anything is allocated,
also on an authenticated pair), and receivers and stores listening on loopback only.
Real receivers and senders in this process, real gloo pairs and gRPC servers."""

from __future__ import annotations

import datetime
import secrets
import time

import grpc
import psutil
import pytest
import torch

from pdserve.kv_transfer import KVPeerError, KVTransferError, State, auth, get_transport
from pdserve.kv_transfer import gloo_wire as wire
from pdserve.kv_transfer import grpc_gate as gate
from pdserve.kv_transfer import kv_transfer_pb2 as pb
from pdserve.kv_transfer.gloo_wire import Kind
from pdserve.kv_transfer.grpc_sender import CHANNEL_OPTIONS, METHOD
from tests.kv_transfer.helpers import SECRET, layout, reference, shard
from tests.kv_transfer.test_integrity import DST_IDS, NUM_BLOCKS, SRC_IDS, Side

OTHER = b"not-the-cluster-secret-0123456789"


def _listening(port: int) -> list[str]:
    """The addresses this process listens on at ``port``, IPv4-mapped ones as IPv4
    (gRPC listens on ::ffff:127.0.0.1 for 127.0.0.1)."""
    conns = psutil.Process().net_connections(kind="inet")
    ips = [c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
    return [ip.removeprefix("::ffff:") for ip in ips]


def _send(sender, side: Side, tid: str, seed: int) -> None:
    side.expect(tid)
    sender.send_all(tid, shard(reference(layout(), NUM_BLOCKS, seed), layout()), SRC_IDS,
                    side.dst(tid))  # fmt: skip
    assert sender.finish(tid, timeout=20).acks[0].status.name == "OK"
    assert side.receivers[0].wait(tid, timeout=20).state == State.LANDED
    side.check(seed)


def test_proofs_bind_secret_receiver_and_transfer():
    lay = layout().to_proto().SerializeToString(deterministic=True)
    one = auth.join_proof(SECRET, "inc-1", "prefill-0", 0, "gen-1", lay)
    assert auth.valid(one, auth.join_proof(SECRET, "inc-1", "prefill-0", 0, "gen-1", lay))
    for other in (
        auth.join_proof(OTHER, "inc-1", "prefill-0", 0, "gen-1", lay),  # another secret
        auth.join_proof(SECRET, "inc-2", "prefill-0", 0, "gen-1", lay),  # another receiver
        auth.join_proof(SECRET, "inc-1", "prefill-1", 0, "gen-1", lay),  # another name
        auth.join_proof(SECRET, "inc-1", "prefill-0", 1, "gen-1", lay),  # another rank
    ):
        assert not auth.valid(one, other)
    nonce = auth.new_nonce()
    push = auth.push_proof(SECRET, "token-a", "prefill-0", lay, nonce)
    assert not auth.valid(push, auth.push_proof(SECRET, "token-b", "prefill-0", lay, nonce))
    assert not auth.valid(push, auth.push_proof(SECRET, "token-a", "prefill-1", lay, nonce))
    seen = auth.Seen()
    assert seen.first(push) and not seen.first(push)
    with pytest.raises(ValueError, match="at least 16 bytes"):
        auth.check_secret(b"short")


def test_gloo_join_without_the_secret_is_refused_and_the_pair_survives():
    """A sender with another secret gets no pair (the receiver refuses its join at once
    and keeps serving); the real sender's pair is untouched and keeps working; a join
    replayed as captured is refused."""
    side = Side("gloo")
    tr = get_transport("gloo")
    real = tr.sender(layout(), secret=SECRET, checksum=True, name="prefill-0")
    spoof = tr.sender(layout(), secret=OTHER, name="prefill-0", connect_timeout=2)
    receiver = side.receivers[0]
    try:
        _send(real, side, "before", 1)
        pair = receiver._pairs[("prefill-0", 0)]
        cache = shard(reference(layout(), NUM_BLOCKS, 2), layout())
        side.expect("spoofed")
        with pytest.raises(KVPeerError):
            spoof.send_all("spoofed", cache, SRC_IDS, side.dst("spoofed"))
        assert receiver.refused == 1
        assert receiver._pairs[("prefill-0", 0)] is pair  # not replaced
        assert receiver.state("spoofed") == State.RESERVED  # not touched
        receiver.release("spoofed")
        _send(real, side, "after", 3)
        # a captured join replayed: the receiver took that proof already
        join = pb.Join(name="prefill-9", rank=0, gen="g1")
        layout().to_proto(join.layout)
        lay = join.layout.SerializeToString(deterministic=True)
        join.proof = auth.join_proof(SECRET, receiver.incarnation, "prefill-9", 0, "g1", lay)
        assert receiver._check_join(join.SerializeToString()).name == "prefill-9"
        with pytest.raises(ValueError, match="replays"):
            receiver._check_join(join.SerializeToString())
        join.proof = auth.join_proof(SECRET, "another-receiver", "prefill-9", 0, "g2", lay)
        join.gen = "g2"
        with pytest.raises(ValueError, match="does not prove"):
            receiver._check_join(join.SerializeToString())
    finally:
        real.close()
        spoof.close()
        side.close()


def test_header_bounds_before_any_allocation():
    """Rows naming a block count of 2^40, a layer or heads outside the cache are refused
    by name; over a real authenticated pair, such a header closes that pair without the
    receiver allocating it, and the sender's next transfer forms a new pair and lands."""
    h = wire.header(Kind.DATA, 1, 0, 0)
    h[wire.H_NSEGS] = 1
    h[wire.HEAD + wire.S_COUNT] = 1 << 40
    with pytest.raises(RuntimeError, match=r"count=1099511627776; allowed: 1 to 16"):
        wire.rows(h, 3, NUM_BLOCKS, 4)
    h[wire.HEAD + wire.S_COUNT], h[wire.HEAD + wire.S_HEAD1] = 1, 9
    with pytest.raises(RuntimeError, match="head_end=9; allowed: 1 to 4"):
        wire.rows(h, 3, NUM_BLOCKS, 4)
    h[wire.HEAD + wire.S_HEAD1], h[wire.HEAD + wire.S_LAYER] = 4, 3
    with pytest.raises(RuntimeError, match="layer=3; allowed: 0 to 2"):
        wire.rows(h, 3, NUM_BLOCKS, 4)

    side = Side("gloo")
    tr = get_transport("gloo")
    sender = tr.sender(layout(), secret=SECRET, checksum=True, name="p")
    try:
        _send(sender, side, "first", 4)
        rss = psutil.Process().memory_info().rss
        h[wire.HEAD + wire.S_LAYER], h[wire.HEAD + wire.S_COUNT] = 0, 1 << 40
        (pair,) = sender._pairs.values()
        pair.pg.send([torch.tensor(h, dtype=torch.int64)], 1, wire.TAG_HDR).wait()
        deadline = time.monotonic() + 10
        while side.receivers[0]._pairs and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not side.receivers[0]._pairs  # that pair was closed
        assert psutil.Process().memory_info().rss - rss < 64 << 20
        sender.close()
        sender = tr.sender(layout(), secret=SECRET, checksum=True, name="p")
        _send(sender, side, "second", 5)  # the receiver serves the next pair
    finally:
        sender.close()
        side.close()


def _push(address: str, *messages: pb.KVChunk, metadata=None) -> pb.PushAck:
    """``messages`` pushed on one stream, opened with ``metadata`` (default: the gate's,
    proved with the cluster's secret for sender "")."""
    if metadata is None:
        metadata = gate.opening(SECRET, "", address)
    with grpc.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        call = channel.stream_unary(METHOD, request_serializer=pb.KVChunk.SerializeToString,
                                    response_deserializer=pb.PushAck.FromString)  # fmt: skip
        return call(iter(messages), timeout=10, metadata=metadata)


def test_grpc_push_needs_the_secret_once_per_stream():
    """A push naming a live transfer's token with another secret's proof is REJECTED
    and leaves the transfer as it was; a correctly proved first message replayed on a
    second stream is REJECTED too."""
    side = Side("grpc")
    receiver = side.receivers[0]
    try:
        side.expect("live")
        lay = layout().to_proto()
        raw = lay.SerializeToString(deterministic=True)
        nonce = auth.new_nonce()
        forged = pb.KVChunk(transfer_id="live", nonce=nonce, src_layout=lay,
                            proof=auth.push_proof(OTHER, "live", "", raw, nonce))  # fmt: skip
        forged.meta.add(layer=0, block_offset=0, num_blocks=(1 << 32) - 1, head_start=0,
                        head_end=4)  # fmt: skip
        ack = _push(receiver.address, forged, pb.KVChunk(end=True))
        assert ack.status == pb.PushAck.REJECTED and "secret" in ack.message
        assert receiver.state("live") == State.RESERVED
        proved = pb.KVChunk(transfer_id="live", nonce=nonce, src_layout=lay,
                            proof=auth.push_proof(SECRET, "live", "", raw, nonce))  # fmt: skip
        assert _push(receiver.address, proved).status == pb.PushAck.INCOMPLETE  # taken
        ack = _push(receiver.address, proved)
        assert ack.status == pb.PushAck.REJECTED and "replays" in ack.message
        assert receiver.refused == 2
        bogus = pb.KVChunk(transfer_id=secrets.token_hex(16))
        assert _push(receiver.address, bogus).status == pb.PushAck.REJECTED
    finally:
        side.close()


@pytest.mark.parametrize("backend", ["gloo", "grpc"])
def test_receivers_listen_on_loopback_only(backend):
    side = Side(backend)
    try:
        port = int(side.receivers[0].address.rsplit(":", 1)[1])
        assert _listening(port) == ["127.0.0.1"]
    finally:
        side.close()


def test_listening_store_binds_the_interface_given():
    store = wire.listening_store("127.0.0.1", 0, datetime.timedelta(seconds=5))
    assert _listening(store.port) == ["127.0.0.1"]
    from pdserve.engine.parallel import serve_store

    tp_store, address = serve_store(SECRET, "127.0.0.1", 0, "127.0.0.1")
    assert _listening(tp_store.port) == ["127.0.0.1"] and address.endswith(f":{tp_store.port}")


@pytest.mark.parametrize("backend", ["gloo", "grpc"])
def test_only_the_expected_sender_feeds_a_reservation(backend):
    """Bytes for a reservation from another (proven) instance than the one it expects
    are refused (its END answered REJECTED) without failing it; the expected sender's
    then land."""
    side = Side(backend)
    tr = get_transport(backend)
    other = tr.sender(layout(), secret=SECRET, checksum=True, name="prefill-1")
    real = tr.sender(layout(), secret=SECRET, checksum=True, name="prefill-0")
    receiver = side.receivers[0]
    try:
        receiver.expect("t", DST_IDS, layout(), lease_s=30, token="t", sender="prefill-0")
        cache = shard(reference(layout(), NUM_BLOCKS, 8), layout())
        other.send_all("t", torch.zeros_like(cache), SRC_IDS, side.dst("t"))
        with pytest.raises(KVTransferError, match="REJECTED.*expected from 'prefill-0'"):
            other.finish("t", timeout=20)
        assert receiver.state("t") == State.RESERVED
        real.send_all("t", cache, SRC_IDS, side.dst("t"))
        assert real.finish("t", timeout=20).acks[0].status.name == "OK"
        assert receiver.wait("t", timeout=20).state == State.LANDED
        side.check(8)
    finally:
        other.close()
        real.close()
        side.close()


def test_the_cluster_secret_comes_from_secret_file_or_is_made(tmp_path):
    from pdserve.cluster.launcher import kv_secret

    assert len(kv_secret(None)) == 32 and kv_secret(None) != kv_secret(None)
    good = tmp_path / "kv.secret"
    good.write_bytes(SECRET + b"\n")
    assert kv_secret(str(good)) == SECRET
    short = tmp_path / "short.secret"
    short.write_bytes(b"0123456789")
    with pytest.raises(ValueError, match=r"kv_transfer.secret_file=.*holds 10 bytes; allowed: at"):
        kv_secret(str(short))
    with pytest.raises(ValueError, match=r"kv_transfer.secret_file=.*cannot be read"):
        kv_secret(str(tmp_path / "missing"))
