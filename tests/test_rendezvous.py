"""The authenticated rendezvous (rendezvous/server.py; docs/kv_transfer.md, "Rendezvous"):
both sides prove the secret before anything of the store is read or written; torch's own
store client, a wrong secret, a server without the secret, a forged frame, stalled
handshakes and oversized values are each refused and change nothing; a real gloo pair
forms through it. Real sockets, a real server thread, real gloo groups."""

from __future__ import annotations

import datetime
import secrets
import socket
import threading
import time

import pytest
import torch
from torch.distributed import PrefixStore, TCPStore

from pdserve.kv_transfer.gloo_wire import GlooGroup
from pdserve.rendezvous import server as store_server
from pdserve.rendezvous.client import RendezvousStore
from pdserve.rendezvous.server import RendezvousServer
from pdserve.rendezvous.wire import HELLO, Channel, Op, RendezvousError, Request

SECRET = b"the-cluster-secret-0123456789abcdef"
OTHER = b"not-the-cluster-secret-0123456789"
SECOND = datetime.timedelta(seconds=1)


@pytest.fixture
def server():
    srv = RendezvousServer("127.0.0.1", 0, SECRET)
    srv.store.set("kv/receiver", b"the card")
    yield srv
    srv.close()


def _client(srv, secret=SECRET) -> RendezvousStore:
    return RendezvousStore("127.0.0.1", srv.port, secret, datetime.timedelta(seconds=5), 2.0)


def test_a_peer_with_the_secret_uses_the_store(server):
    client = _client(server)
    assert client.get("kv/receiver") == b"the card"
    client.set("a", b"1")
    assert server.store.get("a") == b"1"
    assert client.add("n", 3) == 3 and server.store.add("n", 0) == 3
    assert client.check(["a"]) and not client.check(["missing"])
    assert client.compare_set("a", b"1", b"2") == b"2"
    client.queue_push("kv/joins", b"join")
    assert server.store.queue_pop("kv/joins", False) == b"join"
    assert client.delete_key("a") and not client.check(["a"])
    with pytest.raises(RendezvousError, match=r"WAIT \['never'\].*[Tt]imeout"):
        client.wait(["never"], datetime.timedelta(milliseconds=200))
    assert server.refused == 0
    client.close()


def test_a_gloo_pair_forms_through_it(server):
    """Rank 0 on a remote client, rank 1 on the server's store in process."""
    groups = {}

    def form(store, rank):
        groups[rank] = GlooGroup.make_group(PrefixStore("pair/x", store), rank, "127.0.0.1",
                                            datetime.timedelta(seconds=10))  # fmt: skip

    t = threading.Thread(target=form, args=(server.store, 1))
    t.start()
    form(_client(server), 0)
    t.join(timeout=10)
    x, y = torch.arange(8.0), torch.zeros(8)
    work = groups[1].recv([y], 0, 3)
    groups[0].send([x], 1, 3).wait()
    work.wait()
    assert torch.equal(x, y)


def test_without_the_secret_nothing_is_read_or_changed(server):
    before = server.store.num_keys()
    with pytest.raises(RendezvousError, match="refused this side's proof"):
        _client(server, OTHER)

    # torch's own client: it gets the challenge and then a closed connection, never a value
    def torch_client():
        try:
            store = TCPStore("127.0.0.1", server.port, None, False, datetime.timedelta(seconds=2))
            store.set("kv/receiver", b"forged")
        except Exception:  # noqa: BLE001 - refused, as it must be
            pass

    t = threading.Thread(target=torch_client, daemon=True)
    t.start()
    t.join(timeout=30)
    # raw bytes that look like a proof
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        assert s.recv(64)[: len(HELLO)] == HELLO
        s.sendall(secrets.token_bytes(48))
        assert s.recv(64) == b""  # closed, nothing said
    assert server.refused >= 3
    assert server.store.get("kv/receiver") == b"the card"
    assert server.store.num_keys() == before


def test_a_server_without_the_secret_is_refused_before_any_request():
    """A listener posing as a receiver: it answers the client's proof with a made-up
    one. The client refuses it and sends nothing more."""
    listener = socket.create_server(("127.0.0.1", 0))
    got = {}

    def pose():
        conn, _ = listener.accept()
        with conn:
            conn.sendall(HELLO + secrets.token_bytes(16))
            got["proof"] = conn.recv(48)
            conn.sendall(secrets.token_bytes(32))
            conn.settimeout(2)
            got["after"] = conn.recv(1 << 16)

    t = threading.Thread(target=pose, daemon=True)
    t.start()
    port = listener.getsockname()[1]
    with pytest.raises(RendezvousError, match="server does not prove"):
        RendezvousStore("127.0.0.1", port, SECRET, datetime.timedelta(seconds=5), 2.0)
    t.join(timeout=10)
    listener.close()
    assert len(got["proof"]) == 48 and got["after"] == b""  # no request went out


def test_a_forged_frame_closes_that_connection_only(server):
    client = _client(server)
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    from pdserve.rendezvous.wire import client_handshake

    session = client_handshake(sock, SECRET, time.monotonic() + 5)
    forged = Channel(sock, bytes(32), b"c")  # not the session's key
    forged.send(Request(Op.SET, [b"kv/receiver", b"forged"]).encode())
    assert sock.recv(64) == b""
    sock.close()
    assert server.store.get("kv/receiver") == b"the card" and len(session) == 32
    assert client.get("kv/receiver") == b"the card"  # the other connection serves on


def test_sizes_and_counts_are_bounded(server, monkeypatch):
    client = _client(server)
    big = b"x" * (store_server.MAX_VALUE + 1)
    with pytest.raises(RendezvousError, match=r"65537 bytes for b'flood'; allowed: up to 65536"):
        client.set("flood", big)
    with pytest.raises(RendezvousError, match=r"a key of 1025 bytes; allowed: up to 1024"):
        client.get("k" * 1025)
    monkeypatch.setattr(store_server, "MAX_TOTAL", 4 * store_server.MAX_VALUE)
    value = b"x" * store_server.MAX_VALUE
    for i in range(4):
        client.set(f"v{i}", value)
    with pytest.raises(RendezvousError, match="would hold 327680 bytes"):
        client.set("v4", value)
    client.set("v0", b"small")  # replacing a value frees its bytes
    client.set("v4", b"y" * 1000)
    for _ in range(store_server.MAX_QUEUE):
        client.queue_push("q", b"j")
    with pytest.raises(RendezvousError, match="holds 64 values"):
        client.queue_push("q", b"j")
    assert not server.store.check(["flood"]) and server.refused == 0


@pytest.mark.timeout(60)
def test_stalled_handshakes_are_cut_off(server, monkeypatch):
    """More silent connections than handshakes allowed at once: the extra ones are closed
    at once, the rest after ``HANDSHAKE_S``; a real peer gets in within its deadline."""
    stalled = [
        socket.create_connection(("127.0.0.1", server.port), timeout=10)
        for _ in range(store_server.MAX_PENDING + 8)
    ]
    start = time.monotonic()
    client = RendezvousStore("127.0.0.1", server.port, SECRET, SECOND * 5, 10.0)
    assert time.monotonic() - start < store_server.HANDSHAKE_S + 2
    assert client.get("kv/receiver") == b"the card"
    for s in stalled:
        s.settimeout(store_server.HANDSHAKE_S + 5)
        data = s.recv(64)
        while data:  # the challenge, then the close
            data = s.recv(64)
        s.close()
    assert server.refused >= store_server.MAX_PENDING + 8
