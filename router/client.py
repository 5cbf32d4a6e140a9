"""``RouterClient``: the Python client of the router's gRPC API, sync and async.

    client = RouterClient("127.0.0.1:50051")
    for chunk in client.generate("Hello", max_tokens=32):      # streams
        print(chunk.text, end="")
    done = client.complete(messages=[{"role": "user", "content": "Hi"}])
    async for chunk in client.agenerate("Hello"): ...           # same, on asyncio
    RouterClient(address, api_key="...", ca_file="ca.pem")      # a router with keys, TLS

A stream cancels its request (the router frees its KV blocks) when the caller stops
iterating: ``break`` out of the loop, ``stream.cancel()``, leaving a ``with`` block
or dropping the stream. A stream that breaks (UNAVAILABLE: the router died and is
being restarted) resumes by itself from the last token it received (the ``Resume``
RPC; router/client_streams.py), with backoff, until the call's ``timeout`` or, without
one, ``resume_s``: every request gets an id (a new one when the caller gives none).
Errors arrive as ``grpc.RpcError`` (``.code()``, ``.details()``): INVALID_ARGUMENT for
a request that cannot run, RESOURCE_EXHAUSTED when the router's queue is full,
UNAVAILABLE while it starts or drains, UNAUTHENTICATED without a key the router knows.
"""

from __future__ import annotations

import asyncio
import time
import uuid
import weakref
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.router import pdserve_pb2 as pb
from pdserve.router import pdserve_pb2_grpc as pb_grpc
from pdserve.router.client_streams import AsyncStream, Stream
from pdserve.router.client_types import (
    Chunk,
    Completion,
    Timings,
    TokenLogprobs,
    make_request,
)

__all__ = [
    "AsyncStream",
    "Chunk",
    "Completion",
    "RouterClient",
    "Stream",
    "Timings",
    "TokenLogprobs",
    "make_request",
]

# the channel's reconnect backoff after losing its router (gRPC's own: 1 s growing to 120 s)
MIN_RECONNECT_MS = 100
MAX_RECONNECT_MS = 1000
UNARY_TIMEOUT_S = 30.0  # Abort and Stats: the most they wait for a connection and answer


class RouterClient:
    """The router's gRPC API, sync and async.

    ``api_key``: sent as ``authorization: Bearer <key>`` on every call (a router with
    ``router.api_key_file`` refuses calls without one: UNAUTHENTICATED). ``ca_file``:
    PEM CAs that the router's certificate chains to; given (or ``tls=True``, for CAs the
    system trusts) the channel speaks TLS only. ``cert_file``/``key_file``: this
    client's certificate, for a router that requires one (``router.tls.client_ca_file``).
    ``resume_s``: how long a broken stream without a ``timeout`` keeps trying to resume
    (0: never; a stream with a ``timeout`` tries until it).
    """

    def __init__(
        self,
        address: str,
        *,
        api_key: str | None = None,
        ca_file: str | None = None,
        tls: bool = False,
        cert_file: str | None = None,
        key_file: str | None = None,
        resume_s: float = 60.0,
    ):
        self.address = address
        self.resume_s = resume_s
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self._credentials = None
        if tls or ca_file or cert_file:
            self._credentials = grpc.ssl_channel_credentials(
                root_certificates=_read(ca_file),
                private_key=_read(key_file),
                certificate_chain=_read(cert_file),
            )
        self._channel = self._open(grpc)
        self._stub = pb_grpc.RouterStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._aio: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # loop -> channel

    def _open(self, module):
        """A channel of ``module`` (``grpc`` or ``grpc.aio``) to the router, on a
        connection of its own (not shared with another client's channel through gRPC's
        process-wide pool): router replicas share one port and each connection is one
        replica's (router/replicas.py), so separate clients spread over them. It tries to
        reconnect at most ``MAX_RECONNECT_MS`` after losing its router: gRPC's default
        backoff grows to 2 minutes, while a restarted router is back in seconds
        (docs/serving.md, "Router restarts and resuming")."""
        options = [
            ("grpc.use_local_subchannel_pool", 1),
            ("grpc.initial_reconnect_backoff_ms", MIN_RECONNECT_MS),
            ("grpc.min_reconnect_backoff_ms", MIN_RECONNECT_MS),
            ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_MS),
        ]
        if self._credentials is None:
            return module.insecure_channel(self.address, options=options)
        return module.secure_channel(self.address, self._credentials, options=options)

    # ---- sync ----

    def generate(self, prompt: str | None = None, *, timeout: float | None = None, **kw) -> Stream:
        """Stream a completion; keywords as ``make_request``."""
        request = self._request(prompt, kw)
        call = self._stub.Generate(request, timeout=timeout, metadata=self._metadata)
        again = self._regenerator(self._stub, request, timeout)
        return Stream(
            call, request.request_id, self._resumer(self._stub), again, self._until(timeout)
        )

    def _request(self, prompt: str | None, kw: dict) -> pb.GenerateRequest:
        """``make_request``'s, with an id of its own when the caller gave none (a stream
        resumes by it)."""
        request = make_request(prompt, **kw)
        request.request_id = request.request_id or uuid.uuid4().hex
        return request

    def _until(self, timeout: float | None) -> float:
        """The monotonic time up to which a broken stream tries to resume."""
        return time.monotonic() + (self.resume_s if timeout is None else timeout)

    def _resumer(self, stub):
        """What reopens a stream: a ``Resume`` call for a request id and the tokens had."""

        def resume(request_id: str, after: int, timeout: float):
            request = pb.ResumeRequest(request_id=request_id, after=after)
            return stub.Resume(request, timeout=timeout, metadata=self._metadata)

        return resume

    def _regenerator(self, stub, request: pb.GenerateRequest, timeout: float | None):
        """What sends ``request`` again (a call that never reached a router's instances):
        with what is left of ``timeout`` (none: none)."""

        def regenerate(left: float):
            again = None if timeout is None else left
            return stub.Generate(request, timeout=again, metadata=self._metadata)

        return regenerate

    def complete(self, prompt: str | None = None, **kw) -> Completion:
        out = Completion()
        for chunk in self.generate(prompt, **kw):
            out.add(chunk)
        return out

    def abort(self, request_id: str, timeout: float = UNARY_TIMEOUT_S) -> bool:
        """End a request this client's key started; False when there is none. Like
        ``stats``, it waits up to ``timeout`` for a connection (``wait_for_ready``): a
        router restarting, or a handshake slow on a loaded host, is not a failure."""
        request = pb.AbortRequest(request_id=request_id)
        kw = dict(timeout=timeout, wait_for_ready=True, metadata=self._metadata)
        return self._stub.Abort(request, **kw).found

    def stats(self, timeout: float = UNARY_TIMEOUT_S) -> pb.StatsResponse:
        kw = dict(timeout=timeout, wait_for_ready=True, metadata=self._metadata)
        return self._stub.Stats(pb.StatsRequest(), **kw)

    def health(self, service: str = "", timeout: float = 5.0) -> str:
        """SERVING, NOT_SERVING, ... from the standard grpc.health.v1 service."""
        req = health_pb2.HealthCheckRequest(service=service)
        status = self._health.Check(req, timeout=timeout).status
        return health_pb2.HealthCheckResponse.ServingStatus.Name(status)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- async (a channel per event loop) ----

    def _astub(self) -> pb_grpc.RouterStub:
        loop = asyncio.get_running_loop()
        if loop not in self._aio:
            channel = self._open(grpc.aio)
            self._aio[loop] = (channel, pb_grpc.RouterStub(channel))
        return self._aio[loop][1]

    def agenerate(
        self, prompt: str | None = None, *, timeout: float | None = None, **kw
    ) -> AsyncStream:
        """``async for chunk in client.agenerate(...)``; keywords as ``make_request``."""
        request = self._request(prompt, kw)
        stub = self._astub()
        call = stub.Generate(request, timeout=timeout, metadata=self._metadata)
        again = self._regenerator(stub, request, timeout)
        return AsyncStream(
            call, request.request_id, self._resumer(stub), again, self._until(timeout)
        )

    async def acomplete(self, prompt: str | None = None, **kw) -> Completion:
        out = Completion()
        async for chunk in self.agenerate(prompt, **kw):
            out.add(chunk)
        return out

    async def aabort(self, request_id: str, timeout: float = UNARY_TIMEOUT_S) -> bool:
        request = pb.AbortRequest(request_id=request_id)
        kw = dict(timeout=timeout, wait_for_ready=True, metadata=self._metadata)
        return (await self._astub().Abort(request, **kw)).found

    async def astats(self, timeout: float = UNARY_TIMEOUT_S) -> pb.StatsResponse:
        kw = dict(timeout=timeout, wait_for_ready=True, metadata=self._metadata)
        return await self._astub().Stats(pb.StatsRequest(), **kw)

    async def aclose(self) -> None:
        loop = asyncio.get_running_loop()
        if loop in self._aio:
            await self._aio.pop(loop)[0].close()


def _read(path: str | None) -> bytes | None:
    return None if path is None else Path(path).expanduser().read_bytes()
