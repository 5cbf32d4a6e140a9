"""mTLS on the grpc backend (kv_transfer/grpc_tls.py): with ``kv_transfer.tls`` a
transfer lands bit-exact over TLS; a sender without a client certificate of the
cluster's CA (none, another CA's, which also distrusts the receiver, or plain text) gets
no stream: the handshake fails before any handler runs. Real gRPC servers and senders,
certificates from trustme."""

from __future__ import annotations

import grpc
import pytest
import trustme

from pdserve.kv_transfer import KVTransferError, State, get_transport
from pdserve.kv_transfer import grpc_gate as gate
from pdserve.kv_transfer import kv_transfer_pb2 as pb
from pdserve.kv_transfer.grpc_sender import CHANNEL_OPTIONS, METHOD
from pdserve.kv_transfer.grpc_tls import TLSFiles
from tests.kv_transfer.helpers import SECRET, layout, reference, shard
from tests.kv_transfer.test_integrity import NUM_BLOCKS, SRC_IDS, Side


def _files(tmp_path, ca: trustme.CA, name: str) -> TLSFiles:
    """A certificate of ``ca`` for 127.0.0.1 (client and server use), as PEM files."""
    leaf = ca.issue_cert("127.0.0.1")
    paths = {k: tmp_path / f"{name}-{k}.pem" for k in ("cert", "key", "ca")}
    leaf.cert_chain_pems[0].write_to_path(str(paths["cert"]))
    leaf.private_key_pem.write_to_path(str(paths["key"]))
    ca.cert_pem.write_to_path(str(paths["ca"]))
    return TLSFiles(str(paths["cert"]), str(paths["key"]), str(paths["ca"]))


def _sender(tls: TLSFiles | None):
    extra = {} if tls is None else {"tls": tls}
    return get_transport("grpc").sender(layout(), secret=SECRET, checksum=True, name="", **extra)


def _send(sender, side: Side, tid: str, seed: int):
    side.expect(tid)
    cache = shard(reference(layout(), NUM_BLOCKS, seed), layout())
    sender.send_all(tid, cache, SRC_IDS, side.dst(tid))
    return sender.finish(tid, timeout=20)


@pytest.mark.timeout(60)
def test_mtls_lands_exact_and_refuses_a_sender_without_the_certificate(tmp_path):
    ca = trustme.CA()
    mine = _files(tmp_path, ca, "cluster")
    side = Side("grpc", tls=mine)
    receiver = side.receivers[0]
    try:
        sender = _sender(mine)
        try:
            assert _send(sender, side, "over-tls", 7).acks[0].status.name == "OK"
        finally:
            sender.close()
        assert receiver.wait("over-tls", timeout=20).state == State.LANDED
        side.check(7)

        stranger = _files(tmp_path, trustme.CA(), "stranger")  # another CA's certificate
        for tls in (None, stranger):
            sender = _sender(tls)
            try:
                with pytest.raises(KVTransferError):
                    _send(sender, side, f"refused-{tls is None}", 8)
            finally:
                sender.close()
            assert receiver.state(f"refused-{tls is None}") == State.RESERVED
        # the cluster's CA trusted, but no client certificate: refused in the handshake
        ca_only = grpc.ssl_channel_credentials(root_certificates=mine.read()[2])
        with grpc.secure_channel(receiver.address, ca_only, CHANNEL_OPTIONS) as channel:
            call = channel.stream_unary(METHOD, request_serializer=pb.KVChunk.SerializeToString,
                                        response_deserializer=pb.PushAck.FromString)  # fmt: skip
            with pytest.raises(grpc.RpcError) as err:
                call(iter([]), timeout=10, metadata=gate.opening(SECRET, "", receiver.address))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert receiver.refused == 0  # no handler ran for any of them
    finally:
        side.close()


def test_an_unreadable_tls_file_is_named(tmp_path):
    tls = TLSFiles(str(tmp_path / "no-cert.pem"), str(tmp_path / "k"), str(tmp_path / "c"))
    with pytest.raises(ValueError, match=r"kv_transfer.tls.key_file='.*/k': cannot read it"):
        tls.channel()
