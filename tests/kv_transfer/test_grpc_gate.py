"""The grpc backend's stream gate (kv_transfer/grpc_gate.py; docs/kv_transfer.md,
"Closed by default"): a stream is admitted by its metadata before a message of it is
read, idle streams hold no receiver thread and end at the first-message deadline, a
forged, stale, misdirected or replayed opening is refused, and a sender sends nothing
to a receiver that cannot answer its challenge. Real gRPC servers and senders."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest
import torch

from pdserve.kv_transfer import KVDestination, KVTransferError, State, auth, get_transport
from pdserve.kv_transfer import grpc_gate as gate
from pdserve.kv_transfer import kv_transfer_pb2 as pb
from pdserve.kv_transfer.grpc_sender import CHANNEL_OPTIONS, METHOD
from tests.kv_transfer.helpers import SECRET, layout, reference, shard
from tests.kv_transfer.test_integrity import DST_IDS, NUM_BLOCKS, SRC_IDS, Side

OTHER = b"not-the-cluster-secret-0123456789"


class Idle:
    """A request iterator that sends nothing until ``release``."""

    def __init__(self):
        self.go = threading.Event()

    def __iter__(self):
        return self

    def __next__(self):
        self.go.wait(60)
        raise StopIteration


def _calls(address: str):
    channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
    call = channel.stream_unary(METHOD, request_serializer=pb.KVChunk.SerializeToString,
                                response_deserializer=pb.PushAck.FromString)  # fmt: skip
    return channel, call


def _send(side: Side, tid: str, seed: int) -> None:
    sender = get_transport("grpc").sender(layout(), secret=SECRET, checksum=True, name="p")
    try:
        side.expect(tid)
        cache = shard(reference(layout(), NUM_BLOCKS, seed), layout())
        sender.send_all(tid, cache, SRC_IDS, side.dst(tid))
        assert sender.finish(tid, timeout=20).acks[0].status.name == "OK"
        assert side.receivers[0].wait(tid, timeout=20).state == State.LANDED
        side.check(seed)
    finally:
        sender.close()


@pytest.mark.timeout(60)
def test_idle_streams_hold_no_thread_and_meet_the_first_message_deadline():
    """With 2 worker threads, 40 unproven idle streams are refused at once and 40 proven
    idle ones wait without a thread: a transfer lands meanwhile; the proven ones are
    answered INCOMPLETE at the first-message deadline, the unproven ones REJECTED."""
    side = Side("grpc", workers=2, first_message_s=2.0)
    address = side.receivers[0].address
    channel, call = _calls(address)
    idle = Idle()
    try:
        bare = [call.future(idle) for _ in range(40)]
        opened = time.monotonic()
        proven = [call.future(idle, metadata=gate.opening(SECRET, "", address))
                  for _ in range(40)]  # fmt: skip
        for f in bare:
            ack = f.result(timeout=10)
            assert ack.status == pb.PushAck.REJECTED and "without a proof" in ack.message
        _send(side, "through", 3)  # both workers are free: the idle streams hold none
        assert not any(f.done() for f in proven)
        for f in proven:
            ack = f.result(timeout=20)
            assert ack.status == pb.PushAck.INCOMPLETE, ack
            assert "no first message within 2s" in ack.message
        assert time.monotonic() - opened >= 2.0
        assert side.receivers[0].refused == 40
    finally:
        idle.go.set()
        channel.close()
        side.close()


def test_forged_stale_misdirected_or_replayed_openings_are_refused():
    side = Side("grpc")
    receiver = side.receivers[0]
    address = receiver.address
    channel, call = _calls(address)
    try:
        side.expect("live")
        ms = int(time.time() * 1000)
        stale = ms - int(auth.STREAM_WINDOW_S * 1000) - 5000
        challenge = auth.new_nonce()

        def opening(secret=SECRET, at=address, when=ms):
            proof = auth.stream_proof(secret, "p", at, challenge, when)
            return ((gate.SENDER, "p"), (gate.TIME, str(when)), (gate.CHALLENGE, challenge),
                    (gate.PROOF, proof))  # fmt: skip

        cases = {
            "does not prove": opening(secret=OTHER),
            "does not prove ": opening(at="127.0.0.1:1"),  # made for another receiver
            "old; allowed": opening(when=stale),
        }
        for why, md in cases.items():
            ack = call(iter([pb.KVChunk(end=True)]), timeout=10, metadata=md)
            assert ack.status == pb.PushAck.REJECTED and why.strip() in ack.message, ack
        good = opening()
        assert call(iter([]), timeout=10, metadata=good).status == pb.PushAck.INCOMPLETE
        ack = call(iter([]), timeout=10, metadata=good)  # the same opening again
        assert ack.status == pb.PushAck.REJECTED and "replays" in ack.message
        assert receiver.refused == 4
        assert receiver.state("live") == State.RESERVED
        # a proven stream whose first message names another sender than it opened with
        nonce, lay = auth.new_nonce(), layout().to_proto()
        raw = lay.SerializeToString(deterministic=True)
        head = pb.KVChunk(transfer_id="live", nonce=nonce, src_layout=lay, sender="q",
                          proof=auth.push_proof(SECRET, "live", "q", raw, nonce))  # fmt: skip
        ack = call(iter([head]), timeout=10, metadata=gate.opening(SECRET, "p", address))
        assert ack.status == pb.PushAck.REJECTED and "names sender 'q'" in ack.message
        assert receiver.state("live") == State.RESERVED
    finally:
        channel.close()
        side.close()


@pytest.mark.parametrize("answer", ["none", "forged"])
def test_a_receiver_that_cannot_answer_gets_no_kv_byte(answer):
    """A server without the secret (it admits anything, answers no proof or a forged
    one, and counts what it reads): the sender's transfer fails naming why, and not one
    message reached the server."""
    got = []

    def push(requests, context):
        if answer == "forged":
            md = dict(context.invocation_metadata())
            forged = auth.answer_proof(OTHER, "", md.get(gate.CHALLENGE, b""))
            context.send_initial_metadata(((gate.ANSWER, forged),))
        else:
            context.send_initial_metadata(())
        for r in requests:
            got.append(len(r))
        return pb.PushAck(status=pb.PushAck.OK)

    server = grpc.server(futures.ThreadPoolExecutor(4), options=CHANNEL_OPTIONS)
    handler = grpc.stream_unary_rpc_method_handler(
        push, request_deserializer=None, response_serializer=pb.PushAck.SerializeToString
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("pdserve.kv_transfer.KVTransfer",
                                              {"Push": handler}),)
    )  # fmt: skip
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    sender = get_transport("grpc").sender(layout(), secret=SECRET, checksum=True, name="p")
    try:
        dst = KVDestination([f"127.0.0.1:{port}"], DST_IDS, layout(), "grpc", token="t")
        cache = shard(reference(layout(), NUM_BLOCKS, 1), layout())
        with pytest.raises(KVTransferError, match="did not prove the cluster's secret"):
            sender.send_all("t", cache, SRC_IDS, dst)
            sender.finish("t", timeout=10)
        assert got == []
    finally:
        sender.close()
        server.stop(None)


def test_kv_cache_untouched_by_refused_streams():
    """What a refused stream carries is never written: the cache stays zero."""
    side = Side("grpc")
    channel, call = _calls(side.receivers[0].address)
    try:
        side.expect("live")
        head = pb.KVChunk(transfer_id="live", nonce=auth.new_nonce(), data=b"\1" * 4096)
        head.meta.add(layer=0, block_offset=0, num_blocks=1, head_start=0, head_end=4)
        ack = call(iter([head, pb.KVChunk(end=True)]), timeout=10)
        assert ack.status == pb.PushAck.REJECTED
        assert torch.count_nonzero(side.caches[0][:, :, DST_IDS]) == 0
    finally:
        channel.close()
        side.close()
