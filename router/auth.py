"""Who is calling: the router's API keys, checked on both front ends (docs/serving.md,
"Authentication, TLS and limits"): by a middleware of the HTTP one (router/http_api.py)
and an interceptor of the gRPC one (router/grpc_api.py), both over ``ApiKeys``.

Keys come from ``router.api_key_file`` (one key a line; blank lines and lines starting
with ``#`` skipped), never from the YAML itself, so that a config can be shared or
committed without its secrets. With no file every caller is the anonymous owner ``""``.

Invariants:
- A caller presents ``Bearer <key>``: the HTTP header ``Authorization`` on every path
  but ``/health`` (probes), the gRPC metadata ``authorization`` on every method of
  ``pdserve.v1.Router`` (``grpc.health.v1`` stays open). Anything else is refused before
  a handler runs: 401 in OpenAI's error shape, or UNAUTHENTICATED.
- The comparison takes the same time whichever key (or byte) differs: the SHA-256 of
  what the caller sent is compared with every key's by ``hmac.compare_digest`` (equal
  lengths, so not even a key's length shows), none skipped.
- A caller's *owner* is a prefix of its key's digest (``""`` without keys): what the
  core keeps per request (``Abort`` ownership, per-key concurrency); no key is kept.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

_BEARER = "bearer "


class KeyFileError(ValueError):
    """The key file cannot serve: unreadable, empty, or a key with whitespace inside."""


def read_key_file(path: str) -> list[str]:
    """The keys of ``path``; raises ``KeyFileError`` naming the file and the line."""
    try:
        text = Path(path).expanduser().read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise KeyFileError(f"router.api_key_file={path!r}: cannot read it ({e})") from e
    keys = []
    for number, line in enumerate(text.splitlines(), 1):
        key = line.strip()
        if not key or key.startswith("#"):
            continue
        if any(c.isspace() for c in key) or not key.isprintable():
            raise KeyFileError(
                f"router.api_key_file={path!r}: line {number} holds whitespace or "
                "unprintable characters inside a key; allowed: one printable key a line"
            )
        keys.append(key)
    if not keys:
        raise KeyFileError(f"router.api_key_file={path!r}: no key in it; give one key a line")
    return keys


class ApiKeys:
    """The keys the router accepts; ``enabled`` False: anyone, as the owner ``""``."""

    def __init__(self, keys: list[str]):
        self._digests = [hashlib.sha256(k.encode()).digest() for k in keys]

    @classmethod
    def from_config(cls, router_config: dict) -> ApiKeys:
        path = router_config.get("api_key_file")
        return cls(read_key_file(path) if path else [])

    @classmethod
    def of_digests(cls, digests: list[bytes]) -> ApiKeys:
        """The same keys from their SHA-256 digests (``digests``): what a process that
        checks keys but must not hold them is given (cluster/instance_metrics.py)."""
        keys = cls([])
        keys._digests = list(digests)
        return keys

    @property
    def digests(self) -> list[bytes]:
        return list(self._digests)

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def owner(self, authorization: str | None) -> str | None:
        """The owner of an ``Authorization`` value, None when it names no key of ours."""
        if not self.enabled:
            return ""
        if not authorization or authorization[: len(_BEARER)].lower() != _BEARER:
            return None
        given = hashlib.sha256(authorization[len(_BEARER) :].strip().encode()).digest()
        found = None
        for digest in self._digests:  # all of them, so the time does not tell which matched
            if hmac.compare_digest(given, digest):
                found = digest
        return None if found is None else found.hex()[:16]


def refusal(where: str) -> str:
    """What a caller without a known key is told (``where``: how it sends one)."""
    return f"missing or unknown API key: send {where} as 'Bearer <key>' with a key of the router's"
