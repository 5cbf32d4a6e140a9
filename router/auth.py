"""Who is calling: the router's API keys, checked on both front ends (docs/serving.md,
"Authentication, TLS and limits").

Keys come from ``router.api_key_file`` (one key a line; blank lines and lines starting
with ``#`` skipped), never from the YAML itself, so that a config can be shared or
committed without its secrets. With no file every caller is the anonymous owner ``""``.

Invariants:
- A caller presents ``Bearer <key>``: the HTTP header ``Authorization`` on every path
  but ``/health`` (probes), the gRPC metadata ``authorization`` on every method of
  ``pdserve.v1.Router`` (``grpc.health.v1`` stays open). Anything else is refused before
  a handler runs: 401 in OpenAI's error shape, or UNAUTHENTICATED.
- The comparison takes the same time whichever key (or byte) differs: every key is
  compared with ``hmac.compare_digest``, none skipped.
- A caller's *owner* is a digest of its key (``""`` without keys): what the core keeps
  per request (``Abort`` ownership, per-key concurrency); the key itself is kept only
  here.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

import grpc
from aiohttp import web

from router.openai_shapes import error_response

OPEN_HTTP_PATHS = ("/health",)
PROTECTED_SERVICE = "/pdserve.v1.Router/"
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
        self._keys = [k.encode() for k in keys]

    @classmethod
    def from_config(cls, router_config: dict) -> ApiKeys:
        path = router_config.get("api_key_file")
        return cls(read_key_file(path) if path else [])

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def owner(self, authorization: str | None) -> str | None:
        """The owner of an ``Authorization`` value, None when it names no key of ours."""
        if not self.enabled:
            return ""
        if not authorization or authorization[: len(_BEARER)].lower() != _BEARER:
            return None
        given = authorization[len(_BEARER) :].strip().encode()
        found = None
        for key in self._keys:  # all of them, so the time does not tell which matched
            if hmac.compare_digest(given, key):
                found = key
        return None if found is None else hashlib.sha256(found).hexdigest()[:16]

    def grpc_owner(self, context: grpc.aio.ServicerContext) -> str | None:
        """The owner of a gRPC call (its ``authorization`` metadata)."""
        metadata = dict(context.invocation_metadata() or ())
        return self.owner(metadata.get("authorization"))

    def http_middleware(self):
        """An aiohttp middleware: the owner in ``request["owner"]``, or 401."""

        @web.middleware
        async def authenticate(request: web.Request, handler):
            if request.path in OPEN_HTTP_PATHS:
                return await handler(request)
            owner = self.owner(request.headers.get("Authorization"))
            if owner is None:
                resp = error_response(401, _refusal("the Authorization header"))
                resp.headers["WWW-Authenticate"] = 'Bearer realm="pdserve"'
                return resp
            request["owner"] = owner
            return await handler(request)

        return authenticate


def _refusal(where: str) -> str:
    return f"missing or unknown API key: send {where} as 'Bearer <key>' with a key of the router's"


class GrpcAuth(grpc.aio.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) a call to ``pdserve.v1.Router`` without a known key;
    other services (health) pass."""

    def __init__(self, keys: ApiKeys):
        self.keys = keys

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not details.method.startswith(PROTECTED_SERVICE):
            return handler
        metadata = dict(details.invocation_metadata or ())
        if self.keys.owner(metadata.get("authorization")) is not None:
            return handler
        message = _refusal("the metadata 'authorization'")

        async def refuse(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        async def refuse_stream(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
            yield  # an async generator, as a streaming handler is

        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(
                refuse_stream, handler.request_deserializer, handler.response_serializer
            )
        return grpc.unary_unary_rpc_method_handler(
            refuse, handler.request_deserializer, handler.response_serializer
        )
