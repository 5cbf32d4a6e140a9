"""The HTTP front end: the OpenAI-compatible API (docs/serving.md) over the router core
(router/core.py), on the router's event loop beside gRPC.

    POST /v1/completions        one prompt (text or token ids); SSE with "stream": true
    POST /v1/chat/completions   messages, rendered with the model's chat template
    GET  /v1/requests/{id}/stream?after=N
                                resume a streamed request a restarted router rebuilt:
                                SSE of the tokens after the first N (``Last-Event-ID``
                                instead of ``after`` also works), as the original
    GET  /v1/models             the served model
    GET  /health                200 while serving, 503 while loading or draining
    GET  /metrics               Prometheus text (router/metrics.py): the request view,
                                the router's queue, each instance's load
    GET  /metrics/targets       the instances' own metrics endpoints, in Prometheus'
                                HTTP service discovery format (cluster/instance_metrics.py)

docs/openapi.yaml describes this API as served. A request body becomes the core's
``GenerateRequest`` (router/openai_request.py), checked for JSON types there, for the
fields pdserve reads, accepts or refuses (router/openai_fields.py) and for values by
the core; the core's refusals map to HTTP statuses in OpenAI's error shape
(router/openai_shapes.py). A body's ``model``, when given, must name the served model
(router/openai_fields.py ``model_names``), else 404. Extra body fields beyond OpenAI's:
``top_k``, ``ignore_eos``, ``stop_token_ids``, ``repetition_penalty`` (as vLLM accepts them), and
``timeout`` (seconds; past it the request ends with 408). Logprobs
(router/openai_logprobs.py) come in each choice when the body asks for them.

Closed as configured (docs/serving.md, "Authentication, TLS and limits"): with API keys
every path but /health needs ``Authorization: Bearer <key>`` (401 otherwise, before the
handler runs); with ``router.tls`` the port speaks TLS only; a body past
``router.max_body_bytes`` is 413; a client's time is bounded (router/http_gate.py):
its headers, its body (408) and each write of a stream.

Invariants of a generate call: it holds a place in ``core.calls`` from arrival to its
last byte (past the bound, its key's, or without keys its address's: 429 before the
body is read); whatever ends it (finished, refused, timed out, failed, or its client
closing the connection, which cancels the handler) ``core.finish`` takes its request
out of the router and the instances; the status line waits for the request's first
output, so a refusal or a timeout before any output is a plain error response, and one
after it an error event ending the stream.

Resuming (docs/serving.md, "Router restarts and resuming"): every generate response
carries ``X-Request-Id`` (a client's own ``X-Request-Id`` header names its request,
bounded by ``router.max_request_id_chars``); each SSE event of a delta has ``id:`` the
number of tokens sent so far, what a client that lost its connection to a dead router
resumes after, with the chunks of the original API (``RequestStream.front``).
"""

from __future__ import annotations

import time

from aiohttp import web

from pdserve.router import http_choices
from pdserve.router import tls as router_tls
from pdserve.router.auth import ApiKeys
from pdserve.router.core import RouterCore
from pdserve.router.http_gate import (
    REQUEST_ID,
    BodyTimeout,
    Events,
    HeaderDeadlines,
    HttpTimeouts,
    authenticate,
    read_body,
    stream_guard,
)
from pdserve.router.incidents import one_line
from pdserve.router.openai_fields import model_names
from pdserve.router.openai_logprobs import LogprobsShape, PromptReply
from pdserve.router.openai_request import (
    BadRequest,
    OpenAIRequest,
    parse_body,
    read_request,
    requested_model,
    show,
)
from pdserve.router.openai_shapes import (
    Reply,
    error_body,
    error_response,
    internal_errors,
    refusal_event,
    refusal_response,
    usage_object,
)
from pdserve.router.request import Refused
from pdserve.router.stream import Delta, RequestStream

MAX_BODY_BYTES = 8 * 2**20  # router.max_body_bytes's default
BACKLOG = 2048  # connections the kernel queues before they are accepted (uvicorn's)


class HttpApi:
    """The aiohttp server of the router; started and stopped on the router's event loop."""

    def __init__(
        self,
        core: RouterCore,
        model: str,
        keys: ApiKeys | None = None,
        tls: dict | None = None,
        max_body_bytes: int = MAX_BODY_BYTES,
        reuse_port: bool = False,
        timeouts: HttpTimeouts | None = None,
    ):
        """``keys``: None, anyone may call; ``tls``: the ``router.tls`` section (None or
        no ``cert_file``: plain HTTP); ``max_body_bytes``: past it, 413; ``reuse_port``:
        bind with SO_REUSEPORT, the port shared by the router's replicas
        (router/replicas.py); ``timeouts``: how long a client may take over its headers,
        its body and each write of a stream (router/http_gate.py)."""
        self.core, self.model = core, model
        self.names = model_names(model)
        self.created = int(time.time())
        self.max_body_bytes, self.reuse_port = max_body_bytes, reuse_port
        self._tls = tls if tls and router_tls.enabled(tls) else None
        keys = keys or ApiKeys([])
        self.by_address = not keys.enabled  # the per-address bound: only without keys
        self.timeouts = timeouts or HttpTimeouts()
        self._headers = HeaderDeadlines(self.timeouts.header_s)
        gates = [self._headers.middleware, authenticate(keys, core.metrics.refused)]
        app = web.Application(middlewares=[internal_errors, *gates], client_max_size=max_body_bytes)
        app.add_routes(
            [
                web.post("/v1/completions", self.completions),
                web.post("/v1/chat/completions", self.chat_completions),
                web.get("/v1/requests/{request_id}/stream", self.resume),
                web.get("/v1/models", self.models),
                web.get("/health", self.health),
                web.get("/metrics", self.metrics),
                web.get("/metrics/targets", self.metrics_targets),
            ]
        )
        # handler_cancellation: a client closing its connection cancels its handler
        self._runner = web.AppRunner(
            app,
            access_log=None,
            handler_cancellation=True,
            keepalive_timeout=self.timeouts.header_s,  # a kept-alive connection's next headers
        )

    async def start(self, host: str, port: int) -> int:
        """Serve on ``host:port`` (0: any free port); the bound port."""
        await self._runner.setup()
        ssl_context = None if self._tls is None else router_tls.ssl_context(self._tls)
        site = web.TCPSite(
            self._runner,
            host,
            port,
            ssl_context=ssl_context,
            reuse_port=self.reuse_port,
            backlog=BACKLOG,
        )
        try:
            await site.start()
        except OSError as e:
            raise RuntimeError(
                f"router.http_port={port}: cannot bind {host}:{port} ({e}); is it in use?"
            ) from e
        self._headers.start(self._runner)
        return self._runner.addresses[0][1]

    async def stop(self) -> None:
        await self._headers.stop()
        await self._runner.cleanup()

    # ---- handlers ----

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def models(self, request: web.Request) -> web.Response:
        card = {"id": self.model, "object": "model", "created": self.created, "owned_by": "pdserve"}
        return web.json_response({"object": "list", "data": [card]})

    async def health(self, request: web.Request) -> web.Response:
        ok = self.core.serving
        return web.Response(status=200 if ok else 503, text="ok" if ok else "not serving")

    async def metrics(self, request: web.Request) -> web.Response:
        accept = request.headers.get("Accept", "")
        body, content_type = await self.core.exposition(accept)
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def metrics_targets(self, request: web.Request) -> web.Response:
        """One target group per serving instance that serves its metrics (a pool with
        ``metrics_port``), as Prometheus' ``http_sd_configs`` reads it; an instance
        down or restarting is left out until it is readmitted (with its new address)."""
        groups = [
            {
                "targets": [inst.info["metrics"]],
                "labels": {"__meta_pdserve_instance": inst.name, "__meta_pdserve_role": inst.role},
            }
            for inst in self.core.instances
            if inst.alive and "metrics" in inst.info
        ]
        return web.json_response(groups)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        """Every refusal is counted (``core.metrics.refused``) as its response is made."""
        arrival = time.monotonic()
        refused = self.core.metrics.refused
        try:
            address = request.remote if self.by_address else None
            with self.core.calls.call(request.get("owner", ""), address):
                return await self._serve(request, chat, arrival)
        except BodyTimeout as e:
            refused("body_timeout")
            resp = error_response(408, str(e))
            resp.force_close()  # no next request on this connection: its body was never read
            return resp
        except web.HTTPRequestEntityTooLarge:
            refused("body_too_large")
            length = request.content_length  # None: chunked, cut where it passed the bound
            size = "" if length is None else f" {length} bytes,"
            bound = f"router.max_body_bytes={self.max_body_bytes}"
            return error_response(413, f"request body:{size} past {bound}")
        except BadRequest as e:
            refused("invalid")
            return error_response(400, e.message, e.param)
        except Refused as e:  # before any output: the response is the refusal
            refused(e.reason)
            return refusal_response(e)

    async def _serve(self, request: web.Request, chat: bool, arrival: float):
        body = parse_body(await read_body(request, self.timeouts.body_s))
        model = requested_model(body)
        if model is not None and model not in self.names:
            self.core.metrics.refused("model")
            message = f"model={show(model)}: not served here; GET /v1/models lists {self.model!r}"
            return error_response(404, message, "model")
        read = read_request(body, chat)
        read.request.request_id = request.headers.get(REQUEST_ID, "")
        deadline = None if read.timeout_s is None else arrival + read.timeout_s
        owner = request.get("owner", "")
        front = {"api": "chat" if chat else "completions", "include_usage": read.include_usage}
        stream = await self.core.open_stream(read.request, arrival, deadline, owner, front)
        shape = None
        if stream.params.logprobs is not None and read.show_logprobs:
            shape = LogprobsShape(chat, self.core.tokenizer)
        tools = None
        if read.request.tools and read.request.tool_choice != "none":
            assert self.core.validator is not None  # the core took the request: it is ready
            tools = self.core.validator.tool_parser
        prompt = None
        if stream.params.prompt_logprobs is not None:
            echo = stream.params.logprobs if read.echo else None
            prompt = PromptReply(
                shape or LogprobsShape(chat, self.core.tokenizer),
                stream.prompt_ids,
                echo=echo,
                vllm=read.prompt_logprobs,
            )
        reply = Reply(stream.request_id, self.model, chat, shape, tools, prompt)
        streams = [stream, *stream.riders]
        try:
            prefix = self._echo(read)
            if stream.riders:  # n > 1 (prompt logprobs come with n = 1 only)
                replies = [reply] + [
                    Reply(
                        stream.request_id,
                        self.model,
                        chat,
                        LogprobsShape(chat, self.core.tokenizer) if shape else None,
                        tools,
                        index=i,
                    )
                    for i in range(1, len(streams))
                ]
                if not read.stream:
                    return await http_choices.whole(streams, replies, prefix, read.best_of_keep)
                return await http_choices.streamed(
                    request,
                    streams,
                    replies,
                    read.include_usage,
                    prefix,
                    self.timeouts.write_s,
                    self.core.metrics.refused,
                )
            delta = _noted(reply, await stream.read())
            if read.stream:
                return await self._stream(request, stream, reply, read.include_usage, delta, prefix)
            text, logprobs = prefix + delta.text, list(delta.logprobs or [])
            while delta.finish_reason is None and delta.error is None:
                delta = _noted(reply, await stream.read())
                text += delta.text
                logprobs += delta.logprobs or []
            if delta.error is not None:
                return error_response(500, one_line(delta.error))
            usage = usage_object(stream.usage())
            assert delta.finish_reason is not None  # the loop ends on a finish or an error
            whole = reply.whole(text, delta.finish_reason, usage, logprobs)
            return web.json_response(whole, headers={REQUEST_ID: stream.request_id})
        finally:  # finished, failed, refused, or the client went away
            for s in streams:
                self.core.finish(s)

    def _echo(self, read: OpenAIRequest) -> str:
        """The text ``echo`` puts before a completion: the prompt's ("" without echo).
        Called once the core took the request, so token ids are in the vocabulary."""
        req = read.request
        if not read.echo:
            return ""
        if req.prompt is not None:
            return req.prompt
        if self.core.tokenizer is None:
            raise BadRequest("echo: this model has no tokenizer to decode the prompt", "echo")
        assert req.prompt_token_ids is not None  # echo is for completions: prompt or ids
        return self.core.tokenizer.decode(req.prompt_token_ids, skip_special_tokens=False)

    async def resume(self, request: web.Request) -> web.StreamResponse:
        """``GET /v1/requests/{id}/stream?after=N``: a rebuilt request's tokens after the
        client's first N, then the rest, as the SSE of the API it came by; errors as a
        generate's (the core's refusals: 400 for an id it does not hold, 503 while it
        rebuilds)."""
        refused = self.core.metrics.refused
        request_id = request.match_info["request_id"]
        raw = request.query.get("after", request.headers.get("Last-Event-ID", "0"))
        if not raw.isdigit():
            refused("invalid")
            return error_response(400, f"after={show(raw)}: must be an integer >= 0", "after")
        address = request.remote if self.by_address else None
        try:
            with self.core.calls.call(request.get("owner", ""), address):
                stream = self.core.resume(request_id, int(raw), request.get("owner", ""))
                try:
                    chat = stream.front.get("api") == "chat"
                    shape = None
                    if stream.params.logprobs is not None:
                        shape = LogprobsShape(chat, self.core.tokenizer)
                    reply = Reply(stream.request_id, self.model, chat, shape)
                    delta = await stream.read()
                    usage = bool(stream.front.get("include_usage"))
                    return await self._stream(request, stream, reply, usage, delta, sent=int(raw))
                finally:
                    self.core.finish(stream)
        except Refused as e:
            refused(e.reason)
            return refusal_response(e)

    async def _stream(
        self,
        request,
        stream: RequestStream,
        reply,
        include_usage: bool,
        delta,
        prefix: str = "",
        sent: int | None = None,
    ):
        """Server-sent events from the request's first output on (the role chunk and
        the echoed prompt first, when there are some), or with ``sent`` (a resume: the
        tokens the client had) from there; each write bounded by
        ``router.write_timeout_s``."""
        headers = {"Content-Type": "text/event-stream", REQUEST_ID: stream.request_id}
        resp = web.StreamResponse(headers=headers)
        await resp.prepare(request)
        events = Events(request, resp, self.timeouts.write_s)
        async with stream_guard(events, f"stream of request {stream.request_id}"):
            if sent is None and (chat_role := reply.role_chunk()):
                await events.send(chat_role)
            if prefix:
                await events.send(reply.chunk(prefix, None))
            tokens = sent or 0  # sent so far: each delta's event id
            while True:
                tokens += len(delta.token_ids)
                if await self._event(events, stream, reply, include_usage, delta, tokens):
                    break
                try:
                    delta = _noted(reply, await stream.read())
                except Refused as e:
                    self.core.metrics.refused(e.reason)
                    await events.send(refusal_event(e))
                    break
            await events.end()
        return resp

    async def _event(
        self, events, stream: RequestStream, reply, include_usage: bool, delta: Delta, tokens: int
    ) -> bool:
        """Send one delta (``tokens``: how many the client has with it, the event's id);
        True when it was the last."""
        if delta.error is not None:
            await events.send(error_body(500, one_line(delta.error)))
            return True
        chunk = reply.chunk(delta.text, delta.finish_reason, delta.logprobs)
        await events.send(chunk, event_id=tokens)
        if delta.finish_reason is None:
            return False
        if include_usage:
            await events.send(reply.usage_chunk(usage_object(stream.usage())))
        return True


def _noted(reply: Reply, delta: Delta) -> Delta:
    """``delta``, its prompt logprobs (when it brings them) noted for the reply's next
    object."""
    if delta.prompt_logprobs is not None and reply.prompt is not None:
        reply.prompt.pending = delta.prompt_logprobs
    return delta
