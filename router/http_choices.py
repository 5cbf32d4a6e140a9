"""A request of n choices over the HTTP API (``n`` > 1): its n streams (router/core.py,
``RequestStream.riders``) read at once and shown as one OpenAI response, each choice
under its ``index`` (docs/serving.md, "Several choices").

Whole: one object whose ``choices`` are the n replies' (router/openai_shapes.py
``Reply(index=i)``), in index order; usage counts the prompt once and every choice's
tokens. With completions' ``best_of`` past n, the streams are best_of choices and the
object holds the n with the highest mean logprob per token (OpenAI's "best"), best
first, indexed 0 .. n - 1; usage counts every choice generated.

Streamed: each choice's chunks as its deltas arrive, interleaved (chat's role chunk
first for each), then one usage chunk when asked. A choice that fails ends the
response: a 500 before any output, an error event once streaming (as one choice's
failure does with n = 1); a refusal (deadline) likewise. No event ids: a request of
several choices is not resumed by ``after`` (``GET /v1/requests/{id}/stream``).
"""

from __future__ import annotations

from aiohttp import web

from pdserve.router.http_gate import REQUEST_ID, Events, stream_guard
from pdserve.router.incidents import one_line
from pdserve.router.openai_shapes import (
    Reply,
    error_body,
    error_response,
    refusal_event,
    usage_object,
)
from pdserve.router.request import Refused
from pdserve.router.stream import RequestStream, Usage, merged


def usage(streams: list[RequestStream]) -> dict:
    """OpenAI's usage of the n choices: the prompt once, the choices' tokens summed."""
    first = streams[0].usage()
    tokens = sum(s.num_tokens for s in streams)
    return usage_object(Usage(first.prompt_tokens, tokens, first.cached_tokens))


async def whole(
    streams: list[RequestStream], replies: list[Reply], prefix: str, keep: int | None = None
) -> web.Response:
    """The response of a request not streamed: every choice read to its end; ``keep``:
    only that many, the best (completions' ``best_of``: every delta carries logprobs)."""
    texts = [prefix] * len(streams)
    logprobs: list[list] = [[] for _ in streams]
    ends: list[str | None] = [None] * len(streams)
    async for i, delta in merged(streams):
        if delta.error is not None:
            return error_response(500, one_line(delta.error))
        texts[i] += delta.text
        logprobs[i] += delta.logprobs or []
        ends[i] = delta.finish_reason
    total = usage(streams)
    order = list(range(len(streams)))
    if keep is not None:
        order = sorted(order, key=lambda i: -mean_logprob(logprobs[i]))[:keep]
    objects = [
        r.whole(texts[i], ends[i] or "", total, logprobs[i])
        for r, i in zip(replies[: len(order)], order, strict=True)
    ]
    out = {**objects[0], "choices": [o["choices"][0] for o in objects]}
    return web.json_response(out, headers={REQUEST_ID: streams[0].request_id})


def mean_logprob(logprobs: list) -> float:
    """A choice's log probability per token (-inf for one with no token)."""
    return sum(lp.logprob for lp in logprobs) / len(logprobs) if logprobs else float("-inf")


async def streamed(
    request: web.Request,
    streams: list[RequestStream],
    replies: list[Reply],
    include_usage: bool,
    prefix: str,
    write_s: float,
    metrics_refused,
) -> web.StreamResponse:
    """The server-sent events of a streamed request (the module docstring)."""
    headers = {"Content-Type": "text/event-stream", REQUEST_ID: streams[0].request_id}
    resp = web.StreamResponse(headers=headers)
    await resp.prepare(request)
    events = Events(request, resp, write_s)
    async with stream_guard(events, f"stream of request {streams[0].request_id}"):
        for reply in replies:
            if (role := reply.role_chunk()) is not None:
                await events.send(role)
            if prefix:
                await events.send(reply.chunk(prefix, None))
        try:
            async for i, delta in merged(streams):
                if delta.error is not None:
                    await events.send(error_body(500, one_line(delta.error)))
                    break
                await events.send(replies[i].chunk(delta.text, delta.finish_reason, delta.logprobs))
            else:
                if include_usage:
                    await events.send(replies[0].usage_chunk(usage(streams)))
        except Refused as e:
            metrics_refused(e.reason)
            await events.send(refusal_event(e))
        await events.end()
    return resp
