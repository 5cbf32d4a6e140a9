"""The HTTP front end: the OpenAI-compatible API (docs/serving.md) over the router core
(router/core.py), on the router's event loop beside gRPC.

    POST /v1/completions        one prompt (text or token ids); SSE with "stream": true
    POST /v1/chat/completions   messages, rendered with the model's chat template
    GET  /v1/models             the served model
    GET  /health                200 while serving, 503 while loading or draining
    GET  /metrics               Prometheus text: the router's queue, each instance's load

A request body becomes the core's ``GenerateRequest`` (router/request.py), checked
for JSON types here and for values by the core; the core's refusals map to HTTP
statuses (``HTTP_STATUS``) in OpenAI's error shape. Extra body fields beyond OpenAI's:
``top_k``, ``ignore_eos``, ``stop_token_ids`` (as vLLM accepts them).
"""

from __future__ import annotations

import json
import time

from aiohttp import web

from router.core import RouterCore
from router.metrics import prometheus_text
from router.request import ChatMessage, GenerateRequest, Refusal, Refused, SamplingOptions
from router.stream import Usage

HTTP_STATUS = {
    Refusal.INVALID: 400,
    Refusal.EXISTS: 409,
    Refusal.BUSY: 429,
    Refusal.UNAVAILABLE: 503,
}
CHAT_MAX_TOKENS = 512  # when a chat request sets no limit


class BadRequest(Exception):
    pass


def generate_request(body: dict, chat: bool) -> GenerateRequest:
    """An OpenAI request body as the core's ``GenerateRequest``; raises ``BadRequest``
    for a body of the wrong shape or JSON types."""
    req = GenerateRequest()
    if chat:
        req.messages = _messages(body.get("messages"))
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
            prompt = prompt[0]
        if isinstance(prompt, str):
            req.prompt = prompt
        elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            req.prompt_token_ids = prompt
        else:
            raise BadRequest("prompt: one string or one list of token ids per request")
    if body.get("n", 1) != 1:
        raise BadRequest("n: only 1 is supported")
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is None and chat:
        limit = CHAT_MAX_TOKENS
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stop, list) or not all(isinstance(x, str) for x in stop):
        raise BadRequest(f"stop={stop!r}: must be a string or a list of strings")
    stop_token_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_token_ids, list) or not all(_is_int(t) for t in stop_token_ids):
        raise BadRequest(f"stop_token_ids={stop_token_ids!r}: must be a list of integers")
    req.sampling = SamplingOptions(
        max_tokens=_number("max_tokens", limit, integer=True),
        temperature=_number("temperature", body.get("temperature"), integer=False),
        top_k=_number("top_k", body.get("top_k"), integer=True),
        top_p=_number("top_p", body.get("top_p"), integer=False),
        seed=_number("seed", body.get("seed"), integer=True),
        stop=stop,
        stop_token_ids=stop_token_ids,
        ignore_eos=bool(body.get("ignore_eos", False)),
    )
    return req


def _messages(messages) -> list[ChatMessage]:
    if not isinstance(messages, list):
        raise BadRequest("messages: a list of {role, content} is required")
    out = []
    for i, m in enumerate(messages):
        content = m.get("content") or ""
        if isinstance(content, list):  # content parts: keep the text ones
            content = "".join(p.get("text", "") for p in content if p.get("type") == "text")
        if not isinstance(content, str):
            raise BadRequest(
                f"messages[{i}].content={content!r}: must be a string or a list of parts"
            )
        out.append(ChatMessage(str(m.get("role", "user")), content))
    return out


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(key: str, value, integer: bool) -> int | float | None:
    """A JSON number for ``key`` as the core takes it (floats as float); None: unset."""
    if value is None:
        return None
    if integer and not _is_int(value):
        raise BadRequest(f"{key}={value!r}: must be an integer")
    if not integer and (isinstance(value, bool) or not isinstance(value, int | float)):
        raise BadRequest(f"{key}={value!r}: must be a number")
    return value if integer else float(value)


class HttpApi:
    """The aiohttp server of the router; started and stopped on the router's event loop."""

    def __init__(self, core: RouterCore, model: str):
        self.core, self.model = core, model
        self.created = int(time.time())
        app = web.Application()
        app.add_routes(
            [
                web.post("/v1/completions", self.completions),
                web.post("/v1/chat/completions", self.chat_completions),
                web.get("/v1/models", self.models),
                web.get("/health", self.health),
                web.get("/metrics", self.metrics),
            ]
        )
        self._runner = web.AppRunner(app, access_log=None)

    async def start(self, host: str, port: int) -> int:
        """Serve on ``host:port`` (0: any free port); the bound port."""
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        try:
            await site.start()
        except OSError as e:
            raise RuntimeError(
                f"router.http_port={port}: cannot bind {host}:{port} ({e}); is it in use?"
            ) from e
        return self._runner.addresses[0][1]

    async def stop(self) -> None:
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
        return web.Response(text=prometheus_text(await self.core.stats()))

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        arrival = time.monotonic()
        try:
            body = await request.json()
            stream = self.core.open_stream(generate_request(body, chat), arrival)
        except (BadRequest, json.JSONDecodeError, AttributeError, TypeError, ValueError) as e:
            return _error(400, str(e))
        except Refused as e:
            return _error(HTTP_STATUS[e.kind], e.message)
        reply = Reply(stream.request_id, self.model, chat)
        try:
            if body.get("stream"):
                return await self._stream(request, stream, reply, body)
            text, delta = "", None
            while delta is None or delta.finish_reason is None:
                delta = await stream.read()
                if delta.error is not None:
                    return _error(500, delta.error)
                text += delta.text
            return web.json_response(reply.whole(text, delta.finish_reason, _usage(stream.usage())))
        finally:
            self.core.finish(stream)  # finished, failed, or the client went away

    async def _stream(self, request, stream, reply, body) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if chat_role := reply.role_chunk():
            await _send(resp, chat_role)
        while True:
            delta = await stream.read()
            if delta.error is not None:
                await _send(resp, {"error": {"message": delta.error, "type": "server_error"}})
                break
            await _send(resp, reply.chunk(delta.text, delta.finish_reason))
            if delta.finish_reason is not None:
                if (body.get("stream_options") or {}).get("include_usage"):
                    await _send(resp, reply.usage_chunk(_usage(stream.usage())))
                break
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


class Reply:
    """OpenAI's response objects for one request."""

    def __init__(self, request_id: str, model: str, chat: bool):
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.model, self.chat, self.created = model, chat, int(time.time())

    def _base(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def whole(self, text: str, finish_reason: str, usage: dict) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}}
            out = self._base("chat.completion")
        else:
            choice, out = (
                {"index": 0, "text": text, "logprobs": None},
                self._base("text_completion"),
            )
        choice["finish_reason"] = finish_reason
        return {**out, "choices": [choice], "usage": usage}

    def role_chunk(self) -> dict | None:
        if not self.chat:
            return None
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        return {**self._base("chat.completion.chunk"), "choices": [choice]}

    def chunk(self, text: str, finish_reason: str | None) -> dict:
        if self.chat:
            choice = {"index": 0, "delta": {"content": text}}
            out = self._base("chat.completion.chunk")
        else:
            choice, out = (
                {"index": 0, "text": text, "logprobs": None},
                self._base("text_completion"),
            )
        choice["finish_reason"] = finish_reason
        return {**out, "choices": [choice]}

    def usage_chunk(self, usage: dict) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._base(kind), "choices": [], "usage": usage}


def _usage(usage: Usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
    }


async def _send(resp: web.StreamResponse, payload: dict) -> None:
    await resp.write(f"data: {json.dumps(payload)}\n\n".encode())


def _error(status: int, message: str) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return web.json_response(
        {"error": {"message": message, "type": kind, "code": status}}, status=status
    )
