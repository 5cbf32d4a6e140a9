"""What both ends of an authenticated rendezvous share (``rendezvous/server.py``): the
mutual handshake, the MAC'd frames that follow it, and the typed requests and replies.

The handshake proves the cluster's secret both ways before one byte of the store is
read or written (docs/kv_transfer.md, "Rendezvous"):

1. server -> client: ``HELLO`` and a fresh 16-byte challenge ``sc``;
2. client -> server: a fresh challenge ``cc`` and ``HMAC(secret, client, sc, cc)``;
3. server -> client, only when that verifies: ``HMAC(secret, server, cc, sc)``; the
   client goes on only when that verifies (a listener without the secret learns nothing
   and is told nothing).

Every frame after it carries ``HMAC(session, direction, seq, payload)``, where
``session = HMAC(secret, session, sc, cc)`` and ``seq`` counts frames per direction:
a frame forged, replayed, reordered or moved between connections is refused and closes
the connection. Frames are authenticated, not encrypted: store values (the receiver's
card, gloo's pair addresses) are readable on the wire, never the secret.

Invariants: proofs are compared in constant time; a frame is at most ``MAX_FRAME``
bytes, read in full only after its length was checked.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import struct
import time
from dataclasses import dataclass, field
from enum import IntEnum

HELLO = b"PDRV\x01"
CHALLENGE = 16
PROOF = 32
MAX_FRAME = 1 << 20  # most bytes of one frame's payload
MAX_PARTS = 64  # most keys or values in one request


class Op(IntEnum):
    SET = 1
    GET = 2
    ADD = 3
    WAIT = 4
    CHECK = 5
    COMPARE_SET = 6
    DELETE = 7
    NUM_KEYS = 8
    QUEUE_PUSH = 9


class RendezvousError(RuntimeError):
    """The peer did not prove the secret, broke the protocol, or refused a request."""


class RendezvousBusy(RendezvousError):
    """The server closed the connection before its challenge: it was busy with
    ``MAX_PENDING`` handshakes (or going away); worth another try."""


def _mac(key: bytes, purpose: bytes, *fields: bytes) -> bytes:
    h = hmac.new(key, b"pdserve-rendezvous-" + purpose, hashlib.sha256)
    for f in fields:
        h.update(struct.pack("<I", len(f)) + f)
    return h.digest()


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """``n`` bytes; by ``deadline`` (``time.monotonic``) when given, else within the
    socket's timeout per read."""
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise RendezvousError(f"the peer closed the connection ({len(buf)} of {n} bytes)")
        buf += chunk
    return bytes(buf)


def server_handshake(sock: socket.socket, secret: bytes) -> bytes:
    """The session key once the client proved ``secret`` (and was given this side's
    proof); a RendezvousError otherwise, with nothing sent after the challenge."""
    sc = secrets.token_bytes(CHALLENGE)
    sock.sendall(HELLO + sc)
    raw = recv_exact(sock, CHALLENGE + PROOF)
    cc, proof = raw[:CHALLENGE], raw[CHALLENGE:]
    if not hmac.compare_digest(proof, _mac(secret, b"client", sc, cc)):
        raise RendezvousError("the client does not prove the cluster's secret")
    sock.sendall(_mac(secret, b"server", cc, sc))
    return _mac(secret, b"session", sc, cc)


def client_handshake(sock: socket.socket, secret: bytes, deadline: float) -> bytes:
    """The session key once the server proved ``secret`` by ``deadline``
    (``time.monotonic``); a RendezvousError (or a timeout) otherwise."""
    try:
        raw = recv_exact(sock, len(HELLO) + CHALLENGE, deadline)
    except (RendezvousError, ConnectionError) as e:
        raise RendezvousBusy(f"closed before its challenge (busy with handshakes?): {e}") from e
    if raw[: len(HELLO)] != HELLO:
        raise RendezvousError(f"not a pdserve rendezvous (it said {raw[:8]!r})")
    sc, cc = raw[len(HELLO) :], secrets.token_bytes(CHALLENGE)
    sock.sendall(cc + _mac(secret, b"client", sc, cc))
    try:
        theirs = recv_exact(sock, PROOF, deadline)
    except RendezvousError as e:
        raise RendezvousError(f"the server refused this side's proof of the secret: {e}") from e
    if not hmac.compare_digest(theirs, _mac(secret, b"server", cc, sc)):
        raise RendezvousError("the server does not prove the cluster's secret")
    return _mac(secret, b"session", sc, cc)


class Channel:
    """Frames over an authenticated connection: ``send`` and ``recv`` are each used by
    one thread at a time (a client holds its lock; a server answers in order)."""

    def __init__(self, sock: socket.socket, session: bytes, side: bytes):
        self.sock, self.session = sock, session
        self.out_dir, self.in_dir = side, (b"s" if side == b"c" else b"c")
        self.out_seq = self.in_seq = 0

    def send(self, payload: bytes) -> None:
        mac = _mac(self.session, self.out_dir, struct.pack("<Q", self.out_seq), payload)
        self.out_seq += 1
        self.sock.sendall(struct.pack("<I", len(payload)) + mac + payload)

    def recv(self) -> bytes:
        (n,) = struct.unpack("<I", recv_exact(self.sock, 4))
        if n > MAX_FRAME:
            raise RendezvousError(f"a frame of {n} bytes; allowed: up to {MAX_FRAME}")
        mac = recv_exact(self.sock, PROOF)
        payload = recv_exact(self.sock, n)
        want = _mac(self.session, self.in_dir, struct.pack("<Q", self.in_seq), payload)
        if not hmac.compare_digest(mac, want):
            raise RendezvousError(f"frame {self.in_seq} does not carry the session's MAC")
        self.in_seq += 1
        return payload


def _pack_parts(parts: list[bytes]) -> bytes:
    return struct.pack("<B", len(parts)) + b"".join(struct.pack("<I", len(p)) + p for p in parts)


def _unpack_parts(raw: bytes, at: int) -> list[bytes]:
    try:
        return _parts_at(raw, at)
    except struct.error as e:
        raise RendezvousError(f"a malformed message of {len(raw)} bytes: {e}") from e


def _parts_at(raw: bytes, at: int) -> list[bytes]:
    (count,) = struct.unpack_from("<B", raw, at)
    if count > MAX_PARTS:
        raise RendezvousError(f"a message of {count} parts; allowed: up to {MAX_PARTS}")
    at, parts = at + 1, []
    for _ in range(count):
        (n,) = struct.unpack_from("<I", raw, at)
        if at + 4 + n > len(raw):
            raise RendezvousError(f"a part of {n} bytes past the message's {len(raw)}")
        parts.append(raw[at + 4 : at + 4 + n])
        at += 4 + n
    if at != len(raw):
        raise RendezvousError(f"{len(raw) - at} bytes after the message's last part")
    return parts


@dataclass
class Request:
    """``parts``: the keys (then the values) the op names; ``number``: ADD's amount;
    ``timeout_ms``: how long GET and WAIT may wait for their keys."""

    op: Op
    parts: list[bytes] = field(default_factory=list)
    number: int = 0
    timeout_ms: int = 0

    def encode(self) -> bytes:
        return struct.pack("<BqQ", self.op, self.number, self.timeout_ms) + _pack_parts(self.parts)

    @classmethod
    def decode(cls, raw: bytes) -> Request:
        if len(raw) < 18:
            raise RendezvousError(f"a request of {len(raw)} bytes; it needs at least 18")
        op, number, timeout_ms = struct.unpack_from("<BqQ", raw)
        if op not in Op._value2member_map_:
            raise RendezvousError(f"unknown op {op}; allowed: {[int(o) for o in Op]}")
        return cls(Op(op), _unpack_parts(raw, 17), number, timeout_ms)


@dataclass
class Reply:
    """``error``: why the request was refused (empty: done); ``parts``, ``number``: what
    the op returns."""

    error: str = ""
    parts: list[bytes] = field(default_factory=list)
    number: int = 0

    def encode(self) -> bytes:
        return struct.pack("<q", self.number) + _pack_parts([self.error.encode(), *self.parts])

    @classmethod
    def decode(cls, raw: bytes) -> Reply:
        if len(raw) < 9:
            raise RendezvousError(f"a reply of {len(raw)} bytes; it needs at least 9")
        (number,) = struct.unpack_from("<q", raw)
        error, *parts = _unpack_parts(raw, 8)
        return cls(error.decode("utf-8", "replace"), parts, number)
