"""The gRPC front end: the ``pdserve.v1.Router`` service (router/pdserve.proto) and the
standard ``grpc.health.v1`` service, over the router core (router/core.py).

The handlers translate protobuf messages into the core's types (router/request.py,
router/stream.py) and back; a refusal of the core becomes its status code
(``GRPC_STATUS``; BUSY with trailing metadata ``retry-after``, in seconds), a request
an instance failed ends with INTERNAL. Health is set by the owner of the server
(router/server.py): NOT_SERVING from ``start`` until ``set_serving(True)``.

Closed as configured (docs/serving.md, "Authentication, TLS and limits"): with API keys
the ``GrpcAuth`` interceptor (router/grpc_gate.py) refuses a ``Router`` call without a
known key (UNAUTHENTICATED) before its handler runs, health stays open; with ``router.tls`` the
port speaks TLS only; a message past ``router.max_message_bytes`` either way is refused
by gRPC (RESOURCE_EXHAUSTED). ``Abort`` ends only a request of the caller's own key.

Invariants of a Generate call: it holds a place in ``core.calls`` until it returns
(past the bound, its key's, or without keys its peer address's: RESOURCE_EXHAUSTED at
once; Abort, Stats and Health are never bounded, so a client can always cancel and
probe); the call's deadline is the request's (passed: DEADLINE_EXCEEDED); a message its
client takes nothing of for ``router.write_timeout_s`` (HTTP/2 flow control holds the
write: the client stopped reading) ends the call (DEADLINE_EXCEEDED naming the key);
whatever ends it (finished, refused, failed, its deadline, the client cancelling or not
reading) ``core.finish`` takes its request out of the router and the instances. An unexpected
exception reaches the client as INTERNAL with an incident id only (router/incidents.py),
never grpc's "Unexpected <exception>".
"""

from __future__ import annotations

import asyncio
import functools
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve.engine.structured import Guide, GuideError
from pdserve.router import pdserve_pb2 as pb
from pdserve.router import pdserve_pb2_grpc as pb_grpc
from pdserve.router import tls as router_tls
from pdserve.router.auth import ApiKeys
from pdserve.router.core import RouterCore
from pdserve.router.grpc_gate import SERVICE_NAME, GrpcAuth, Unparsable, add_router, peer_address
from pdserve.router.incidents import internal_error, one_line
from pdserve.router.request import (
    OPTIONAL_SAMPLING,
    ChatMessage,
    GenerateRequest,
    Refusal,
    Refused,
    SamplingOptions,
)
from pdserve.router.stream import Delta, RequestStream, Timings, merged

MAX_MESSAGE_BYTES = 8 * 2**20  # router.max_message_bytes's default
WRITE_TIMEOUT_S = 60.0  # router.write_timeout_s's default
GRPC_STATUS = {
    Refusal.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    Refusal.EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    Refusal.BUSY: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Refusal.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    Refusal.DEADLINE: grpc.StatusCode.DEADLINE_EXCEEDED,
}
_STAT_FIELDS = (
    "queued",
    "running",
    "free_blocks",
    "total_blocks",
    "outstanding",
    "requests_total",
    "tokens_total",
    "steps_total",
    "kernels",
)


class GrpcApi:
    """The gRPC server of the router: ``Router`` and ``grpc.health.v1`` on one port.

    Built, started and stopped on the router's event loop."""

    def __init__(
        self,
        core: RouterCore,
        keys: ApiKeys | None = None,
        tls: dict | None = None,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        reuse_port: bool = False,
        write_timeout_s: float = WRITE_TIMEOUT_S,
    ):
        """``keys``: None, anyone may call; ``tls``: the ``router.tls`` section (None or
        no ``cert_file``: plain text); ``max_message_bytes``: each way (gRPC refuses a
        larger one with RESOURCE_EXHAUSTED naming both sizes); ``reuse_port``: bind with
        SO_REUSEPORT, the port shared by the router's replicas (router/replicas.py);
        ``write_timeout_s``: how long a stream's message may wait for its client to read."""
        keys = keys or ApiKeys([])
        limits = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.so_reuseport", int(reuse_port)),
        ]
        interceptors = [GrpcAuth(keys, core.metrics.refused)]
        self._server = grpc.aio.server(interceptors=interceptors, options=limits)
        self._tls = tls if tls and router_tls.enabled(tls) else None
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        add_router(RouterService(core, keys, write_timeout_s), self._server)

    async def start(self, host: str, port: int) -> int:
        """Serve on ``host:port`` (0: any free port), NOT_SERVING; the bound port."""
        await self.set_serving(False)
        address = f"{host}:{port}"
        try:
            if self._tls is None:
                bound = self._server.add_insecure_port(address)
            else:
                key, chain, client_ca = router_tls.pem_files(self._tls)
                credentials = grpc.ssl_server_credentials(
                    [(key, chain)],
                    root_certificates=client_ca,
                    require_client_auth=client_ca is not None,
                )
                bound = self._server.add_secure_port(address, credentials)
        except RuntimeError as e:
            raise RuntimeError(
                f"router.port={port}: cannot bind {host}:{port} ({e}); is it in use?"
            ) from e
        await self._server.start()
        return bound

    async def set_serving(self, serving: bool) -> None:
        """The health status of ``""`` and ``pdserve.v1.Router``."""
        status = health_pb2.HealthCheckResponse.SERVING
        if not serving:
            status = health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self._health.set(name, status)

    async def stop(self, grace_s: float) -> None:
        await self._health.enter_graceful_shutdown()
        await self._server.stop(grace_s)


async def _abort(context, refused: Refused) -> None:
    """End the call with the refusal's status, its kind as trailing metadata
    ``pdserve-refusal`` (what tells a client the router answered, from a call that never
    reached one: router/client_streams.py), and ``retry-after`` when it has one."""
    trailing: tuple[tuple[str, str], ...] = (("pdserve-refusal", refused.kind.value),)
    if refused.retry_after_s is not None:
        trailing += (("retry-after", str(refused.retry_after_s)),)
    await context.abort(GRPC_STATUS[refused.kind], refused.message, trailing_metadata=trailing)


def _owner(keys: ApiKeys, context) -> str:
    """The owner of a call: its ``authorization`` metadata's (router/auth.py)."""
    owner = keys.owner(dict(context.invocation_metadata() or ()).get("authorization"))
    assert owner is not None  # GrpcAuth let the call in: its key is ours, or keys are off
    return owner


def _no_tracebacks(handler):
    """A unary handler whose unexpected exceptions end the call with INTERNAL and an
    incident id (the traceback goes to the log); an ``Unparsable`` request is answered
    INVALID_ARGUMENT."""

    @functools.wraps(handler)
    async def wrapped(self, request, context):
        if isinstance(request, Unparsable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        try:
            return await handler(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception:
            await context.abort(grpc.StatusCode.INTERNAL, internal_error(handler.__name__))

    return wrapped


class RouterService(pb_grpc.RouterServicer):
    """The ``pdserve.v1.Router`` handlers: translate, call the core, translate back."""

    def __init__(self, core: RouterCore, keys: ApiKeys, write_timeout_s: float = WRITE_TIMEOUT_S):
        self.core, self.keys, self.write_timeout_s = core, keys, write_timeout_s

    async def _write(self, context, message: pb.GenerateResponse) -> None:
        """Send one message of a stream, or end the call once its client has taken
        nothing for ``write_timeout_s`` (the write waits on HTTP/2 flow control)."""
        try:
            async with asyncio.timeout(self.write_timeout_s):
                await context.write(message)
        except TimeoutError:
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"the client read nothing for router.write_timeout_s={self.write_timeout_s:g} s",
            )

    async def Generate(self, request, context):
        arrival = time.monotonic()

        async def opened(owner: str, deadline: float | None) -> RequestStream:
            return await self.core.open_stream(generate_request(request), arrival, deadline, owner)

        await self._stream_call("Generate", request, context, opened)

    async def Resume(self, request, context):
        """A rebuilt request's tokens after ``request.after``, then the rest (as Generate)."""

        async def opened(owner: str, deadline: float | None) -> RequestStream:
            return self.core.resume(request.request_id, request.after, owner, deadline)

        await self._stream_call("Resume", request, context, opened)

    async def _stream_call(self, name: str, request, context, opened) -> None:
        """What a streaming call does around ``opened(owner, deadline)``, its stream: the
        request parsed, a place in ``core.calls`` held to its end, the call's deadline the
        stream's, a refusal answered with its status, anything else INTERNAL."""
        if isinstance(request, Unparsable):
            self.core.metrics.refused("invalid")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        owner = _owner(self.keys, context)
        address = None if self.keys.enabled else peer_address(context.peer())
        try:
            with self.core.calls.call(owner, address):
                left = context.time_remaining()  # None: the call has no deadline
                deadline = None if left is None else time.monotonic() + left
                await self._relay(await opened(owner, deadline), context)
        except Refused as e:
            self.core.metrics.refused(e.reason)
            await _abort(context, e)
        except grpc.aio.AbortError:
            raise
        except Exception:
            await context.abort(grpc.StatusCode.INTERNAL, internal_error(name))

    async def _relay(self, stream: RequestStream, context) -> None:
        """The messages of the stream and its other choices' (``riders``) to their end
        (each bounded by ``_write``); ``core.finish`` whatever ends them."""
        streams = [stream, *stream.riders]
        try:
            await context.send_initial_metadata((("request-id", stream.request_id),))
            async for i, delta in merged(streams):
                if delta.error is not None:
                    await context.abort(grpc.StatusCode.INTERNAL, one_line(delta.error))
                msg = generate_response(streams[i], delta)
                msg.request_id, msg.index = stream.request_id, i
                await self._write(context, msg)
        finally:
            for s in streams:  # ended, refused, failed, or the client left
                self.core.finish(s)

    @_no_tracebacks
    async def Abort(self, request, context):
        owner = _owner(self.keys, context)
        found = await self.core.abort_anywhere(request.request_id, owner)
        return pb.AbortResponse(found=found)

    @_no_tracebacks
    async def Stats(self, request, context):
        s = await self.core.stats()
        out = pb.StatsResponse(
            queued=s["queued"],
            max_queue=s["max_queue"],
            in_flight=s["in_flight"],
            draining=s["draining"],
        )
        for inst in s["instances"]:
            out.instances.append(
                pb.InstanceStats(
                    name=inst["name"],
                    role=inst["role"],
                    **{k: inst[k] for k in _STAT_FIELDS if k in inst},
                )
            )
        return out


def generate_request(msg: pb.GenerateRequest) -> GenerateRequest:
    """A protobuf ``GenerateRequest`` in the core's terms: the input the ``oneof`` holds
    (an empty one included), the sampling fields that are set. Raises ``Refused``
    (INVALID) for a ``request_id`` that cannot go back as gRPC metadata (its length is
    the core's to bound, router/intake.py)."""
    if not (msg.request_id.isascii() and msg.request_id.isprintable()):
        raise Refused(
            Refusal.INVALID,
            f"request_id={msg.request_id[:40]!r}: must be printable ASCII "
            "(it is sent back as the metadata request-id)",
        )
    s = msg.sampling
    guide, guide_field = None, SamplingOptions.guide_field
    if s.HasField("guide"):
        try:
            guide, guide_field = Guide(s.guide.kind, s.guide.spec), "sampling.guide"
        except GuideError as e:
            raise Refused(Refusal.INVALID, f"sampling.{e}") from None
    req = GenerateRequest(
        sampling=SamplingOptions(
            **{name: getattr(s, name) for name in OPTIONAL_SAMPLING if s.HasField(name)},
            stop=list(s.stop),
            stop_token_ids=list(s.stop_token_ids),
            ignore_eos=s.ignore_eos,
            guide=guide,
            guide_field=guide_field,
            n=s.n if s.HasField("n") else 1,
        ),
        request_id=msg.request_id,
    )
    kind = msg.WhichOneof("input")
    if kind == "prompt":
        req.prompt = msg.prompt
    elif kind == "messages":
        req.messages = [ChatMessage(m.role, m.content) for m in msg.messages.messages]
    elif kind == "prompt_token_ids":
        req.prompt_token_ids = list(msg.prompt_token_ids.ids)
    return req


def generate_response(stream: RequestStream, delta: Delta) -> pb.GenerateResponse:
    """One message of the stream; the last (with a finish reason) has usage and timings."""
    msg = pb.GenerateResponse(
        request_id=stream.request_id, token_ids=delta.token_ids, text=delta.text
    )
    for lp in delta.logprobs or ():
        msg.logprobs.add(
            token_id=lp.token_id,
            logprob=lp.logprob,
            top_ids=lp.top_ids,
            top_logprobs=lp.top_logprobs,
        )
    for plp in delta.prompt_logprobs or ():
        if plp is None:  # the first prompt token's: it has none
            continue
        msg.prompt_logprobs.add(
            token_id=plp.token_id,
            logprob=plp.logprob,
            top_ids=plp.top_ids,
            top_logprobs=plp.top_logprobs,
            rank=plp.rank,
        )
    if delta.finish_reason is not None:
        usage = stream.usage()
        msg.finish_reason = delta.finish_reason
        msg.usage.prompt_tokens = usage.prompt_tokens
        msg.usage.completion_tokens = usage.completion_tokens
        msg.usage.cached_tokens = usage.cached_tokens
        msg.timings.CopyFrom(timings_message(stream.timings()))
    return msg


def timings_message(timings: Timings) -> pb.Timings:
    """``Timings`` as the protobuf message (same field names)."""
    return pb.Timings(**{**vars(timings), "phases": pb.Phases(**vars(timings.phases))})
