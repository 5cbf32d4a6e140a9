"""The KV plane's handshake proofs: a sender shows it holds the cluster's secret
(docs/kv_transfer.md, "Closed by default").

One secret per cluster (``kv_transfer.secret_file``, else made at launch). Every gloo
join and every grpc ``Push`` stream opens with an HMAC-SHA256 over what identifies it;
the bulk bytes are not authenticated (they follow on the connection the handshake
opened). Invariants:

- a proof binds its purpose (``join`` / ``push``) and every field the receiver acts on:
  a join's receiver incarnation, sender name, rank, pair generation and layout; a
  push's transfer token, sender name, source layout and a fresh nonce. Changing any of them breaks
  the proof, so a captured one is good only for what it was made for;
- a receiver takes each proof once (``Seen``): a replay of a captured join (same
  generation) or push (same nonce) is refused;
- a grpc stream is admitted before the receiver reads a message of it: the call's
  metadata carries a ``stream_proof`` over (sender, the receiver's address, a fresh
  challenge, the time), taken once and only within ``STREAM_WINDOW_S`` of the
  receiver's clock (so ``Seen`` need remember a proof no longer than that); the receiver
  answers with an ``answer_proof`` over the challenge, which the sender checks before it
  sends any KV: each side proves the secret to the other;
- proofs are compared in constant time (``hmac.compare_digest``);
- the secret is never logged, printed, or put in stats or messages.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
import threading
from collections import OrderedDict

MIN_SECRET_BYTES = 16
NONCE_BYTES = 16
STREAM_WINDOW_S = 60.0  # a stream proof's time may differ from the receiver's this much


def new_secret() -> bytes:
    """A cluster's secret, when the config names none."""
    return secrets.token_bytes(32)


def new_token() -> str:
    """A transfer's wire name: 128 random bits, so nobody can guess a live one."""
    return secrets.token_hex(16)


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def check_secret(secret: bytes) -> bytes:
    """``secret`` when it can key the handshake, else a ValueError naming what is allowed."""
    if not isinstance(secret, bytes) or len(secret) < MIN_SECRET_BYTES:
        got = f"{len(secret)} bytes" if isinstance(secret, bytes) else type(secret).__name__
        raise ValueError(
            f"the KV plane's secret is {got}; it must be at least "
            f"{MIN_SECRET_BYTES} bytes (kv_transfer.secret_file)"
        )
    return secret


def _mac(secret: bytes, purpose: str, *fields) -> bytes:
    """HMAC-SHA256 over length-prefixed fields (no two field lists encode alike)."""
    h = hmac.new(secret, purpose.encode(), hashlib.sha256)
    for f in fields:
        raw = f if isinstance(f, bytes) else str(f).encode()
        h.update(struct.pack("<I", len(raw)) + raw)
    return h.digest()


def join_proof(
    secret: bytes, incarnation: str, name: str, rank: int, gen: str, layout: bytes
) -> bytes:
    """A gloo join's proof, for the receiver ``incarnation`` (read from its card)."""
    return _mac(secret, "pdserve-kv-join", incarnation, name, rank, gen, layout)


def push_proof(secret: bytes, token: str, sender: str, layout: bytes, nonce: bytes) -> bytes:
    """A grpc Push stream's proof, for transfer ``token`` from instance ``sender``."""
    return _mac(secret, "pdserve-kv-push", token, sender, layout, nonce)


def stream_proof(secret: bytes, sender: str, address: str, challenge: bytes, ms: int) -> bytes:
    """A grpc stream's admission: instance ``sender`` opens a stream to the receiver at
    ``address`` at ``ms`` (Unix time, milliseconds), with a fresh ``challenge``."""
    return _mac(secret, "pdserve-kv-stream", sender, address, challenge, ms)


def answer_proof(secret: bytes, address: str, challenge: bytes) -> bytes:
    """The receiver at ``address``'s answer to a stream's ``challenge``."""
    return _mac(secret, "pdserve-kv-answer", address, challenge)


def valid(expected: bytes, given: bytes) -> bool:
    return hmac.compare_digest(expected, given)


class Seen:
    """The proofs a receiver took, the newest ``size``: a second use is a replay."""

    def __init__(self, size: int = 1 << 16):
        self.size = size
        self._seen: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()

    def first(self, proof: bytes) -> bool:
        """Whether ``proof`` is new (it is remembered from now on)."""
        with self._lock:
            if proof in self._seen:
                return False
            self._seen[proof] = None
            while len(self._seen) > self.size:
                self._seen.popitem(last=False)
            return True
