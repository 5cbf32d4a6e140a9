"""The OpenAI-compatible HTTP API (docs/serving.md), on the router's event loop beside gRPC.

    POST /v1/completions        one prompt (text or token ids); SSE with "stream": true
    POST /v1/chat/completions   messages, rendered with the model's chat template
    GET  /v1/models             the served model
    GET  /health                200 while serving, 503 while loading or draining
    GET  /metrics               Prometheus text: the router's queue, each instance's load

A request takes the gRPC path's validation, admission and placement
(``RouterServer.open_stream``); its refusals map to HTTP statuses in OpenAI's error
shape. Extra body fields beyond OpenAI's: ``top_k``, ``ignore_eos``, ``stop_token_ids``
(as vLLM accepts them).
"""

from __future__ import annotations

import json
import time

import grpc
from aiohttp import web

from router import pdserve_pb2 as pb
from router.server import Refused
from router.stream import merge_waiting

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
}
CHAT_MAX_TOKENS = 512  # when a chat request sets no limit


class BadRequest(Exception):
    pass


def generate_request(body: dict, chat: bool) -> pb.GenerateRequest:
    """An OpenAI request body as our ``GenerateRequest``."""
    req = pb.GenerateRequest()
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise BadRequest("messages: a list of {role, content} is required")
        for m in messages:
            content = m.get("content") or ""
            if isinstance(content, list):  # content parts: keep the text ones
                content = "".join(p.get("text", "") for p in content if p.get("type") == "text")
            req.messages.messages.add(role=str(m.get("role", "user")), content=content)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
            prompt = prompt[0]
        if isinstance(prompt, str):
            req.prompt = prompt
        elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            req.prompt_token_ids.ids.extend(prompt)
        else:
            raise BadRequest("prompt: one string or one list of token ids per request")
    if body.get("n", 1) != 1:
        raise BadRequest("n: only 1 is supported")
    s = req.sampling
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is None and chat:
        limit = CHAT_MAX_TOKENS
    for key, value in (("max_tokens", limit), ("temperature", body.get("temperature"))):
        if value is not None:
            setattr(s, key, value)
    for key in ("top_p", "top_k", "seed"):
        if body.get(key) is not None:
            setattr(s, key, body[key])
    stop = body.get("stop")
    s.stop.extend([stop] if isinstance(stop, str) else stop or [])
    s.stop_token_ids.extend(body.get("stop_token_ids") or [])
    s.ignore_eos = bool(body.get("ignore_eos", False))
    return req


class HttpApi:
    def __init__(self, router, model: str):
        self.router, self.model = router, model  # router.server.RouterServer
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
        r = self.router
        ok = r.ready and r.alive and not r.draining
        return web.Response(status=200 if ok else 503, text="ok" if ok else "not serving")

    async def metrics(self, request: web.Request) -> web.Response:
        from router.metrics import prometheus_text

        return web.Response(text=prometheus_text(await self.router.stats()))

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        arrival = time.monotonic()
        try:
            body = await request.json()
            stream = self.router.open_stream(generate_request(body, chat), arrival)
        except (BadRequest, json.JSONDecodeError, AttributeError, TypeError, ValueError) as e:
            return _error(400, str(e))
        except Refused as e:
            return _error(HTTP_STATUS.get(e.code, 500), e.message)
        reply = Reply(stream.request_id, self.model, chat)
        try:
            if body.get("stream"):
                return await self._stream(request, stream, reply, body)
            text, delta = "", None
            while delta is None or delta.finish_reason is None:
                delta = merge_waiting(await stream.queue.get(), stream.queue)
                if delta.error is not None:
                    return _error(500, delta.error)
                text += delta.text
            return web.json_response(reply.whole(text, delta.finish_reason, _usage(stream)))
        finally:
            self.router.finish(stream)  # finished, failed, or the client went away

    async def _stream(self, request, stream, reply, body) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if chat_role := reply.role_chunk():
            await _send(resp, chat_role)
        while True:
            delta = merge_waiting(await stream.queue.get(), stream.queue)
            if delta.error is not None:
                await _send(resp, {"error": {"message": delta.error, "type": "server_error"}})
                break
            await _send(resp, reply.chunk(delta.text, delta.finish_reason))
            if delta.finish_reason is not None:
                if (body.get("stream_options") or {}).get("include_usage"):
                    await _send(resp, reply.usage_chunk(_usage(stream)))
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


def _usage(stream) -> dict:
    prompt, completion = len(stream.prompt_ids), stream.num_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


async def _send(resp: web.StreamResponse, payload: dict) -> None:
    await resp.write(f"data: {json.dumps(payload)}\n\n".encode())


def _error(status: int, message: str) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return web.json_response(
        {"error": {"message": message, "type": kind, "code": status}}, status=status
    )
