"""The grpc backend's stream gate: both ends of a ``Push`` stream prove the cluster's
secret to each other before any KV moves (docs/kv_transfer.md, "Closed by default").

1. The sender opens the call with metadata (``opening``): its instance name, a fresh
   16-byte challenge, the time (Unix ms) and a ``stream_proof`` over them and the
   receiver's address (``kv_transfer/auth.py``).
2. The receiver checks it (``admit``) before it reads a message: a missing, forged,
   stale (outside ``auth.STREAM_WINDOW_S``) or replayed proof ends the call at once,
   answered REJECTED; no message of it is read, no transfer touched.
3. An admitted call is answered with initial metadata carrying the receiver's
   ``answer_proof`` over the challenge (``answer``); the sender checks it (``answered``)
   before its first message goes, and fails the stream otherwise.

Invariants: every comparison is constant-time; metadata values are bounded (a name of
at most ``MAX_NAME`` characters, fixed-size challenge and proof) before any MAC runs.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from pdserve.kv_transfer import auth

SENDER, TIME = "pdserve-kv-sender", "pdserve-kv-time"
CHALLENGE, PROOF = "pdserve-kv-challenge-bin", "pdserve-kv-proof-bin"
ANSWER = "pdserve-kv-answer-bin"
MAX_NAME = 256  # most characters of a sender's name
PROOF_BYTES = 32


@dataclass(frozen=True)
class Admitted:
    """A stream that passed the gate: who opened it, and what to answer."""

    sender: str
    challenge: bytes


def opening(secret: bytes, sender: str, address: str) -> tuple[tuple[str, str | bytes], ...]:
    """The metadata a sender opens a stream to ``address`` with."""
    challenge, ms = auth.new_nonce(), int(time.time() * 1000)
    proof = auth.stream_proof(secret, sender, address, challenge, ms)
    return ((SENDER, sender), (TIME, str(ms)), (CHALLENGE, challenge), (PROOF, proof))


def admit(
    secret: bytes, address: str, metadata: Iterable[tuple[str, str | bytes]], seen: auth.Seen
) -> Admitted | str:
    """The stream ``metadata`` opens to the receiver at ``address``, or why it is refused."""
    md = dict(metadata)
    sender, ms, challenge, proof = (md.get(k) for k in (SENDER, TIME, CHALLENGE, PROOF))
    if not (
        isinstance(sender, str)
        and len(sender) <= MAX_NAME
        and isinstance(ms, str)
        and ms.isdigit()
        and len(ms) <= 16
        and isinstance(challenge, bytes)
        and len(challenge) == auth.NONCE_BYTES
        and isinstance(proof, bytes)
        and len(proof) == PROOF_BYTES
    ):
        return "the stream opens without a proof of the cluster's secret"
    if not auth.valid(auth.stream_proof(secret, sender, address, challenge, int(ms)), proof):
        return "the stream does not prove the cluster's secret"
    skew = abs(time.time() - int(ms) / 1000)
    if skew > auth.STREAM_WINDOW_S:
        return f"the stream's proof is {skew:.0f}s old; allowed: {auth.STREAM_WINDOW_S:g}s"
    if not seen.first(proof):
        return "the stream replays another stream's proof"
    return Admitted(sender, challenge)


def answer(secret: bytes, address: str, admitted: Admitted) -> tuple[tuple[str, bytes], ...]:
    """The initial metadata a receiver answers an admitted stream with."""
    return ((ANSWER, auth.answer_proof(secret, address, admitted.challenge)),)


def answered(
    secret: bytes, address: str, opened: tuple, metadata: Iterable[tuple[str, str | bytes]] | None
) -> bool:
    """Whether the receiver at ``address`` answered the stream opened with ``opened``
    (``opening``'s metadata) with the proof only a holder of the secret can make."""
    got = dict(metadata or ()).get(ANSWER)
    challenge = dict(opened)[CHALLENGE]
    expected = auth.answer_proof(secret, address, challenge)
    return isinstance(got, bytes) and auth.valid(expected, got)
