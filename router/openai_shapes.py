"""OpenAI's response objects and error shape for the HTTP front end
(router/http_api.py), and the HTTP statuses of the core's refusals.

``Reply`` builds one request's completion, chunk and usage objects (with the logprobs
objects of router/openai_logprobs.py when the request asked for them).

Every error a client gets over HTTP is ``{"error": {"message", "type", "param",
"code"}}`` with ``code`` the HTTP status: as a response, or as an event of a stream
whose headers were already sent. A BUSY refusal also carries ``Retry-After`` (seconds).
Messages are one line; exception text never reaches a client (router/incidents.py).
"""

from __future__ import annotations

import time

from aiohttp import web

from pdserve.engine.outputs import Logprobs
from pdserve.router.incidents import internal_error
from pdserve.router.openai_logprobs import LogprobsShape, PromptReply
from pdserve.router.openai_tools import ToolStream, calls_json
from pdserve.router.request import Refusal, Refused
from pdserve.router.stream import Usage
from pdserve.router.tool_parsers import ToolParser

HTTP_STATUS = {
    Refusal.INVALID: 400,
    Refusal.EXISTS: 409,
    Refusal.BUSY: 429,
    Refusal.UNAVAILABLE: 503,
    Refusal.DEADLINE: 408,
}
_TYPES = {404: "NotFoundError", 408: "timeout_error", 429: "rate_limit_error"}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """OpenAI's error object for ``status``; ``param``: the request field at fault."""
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None) -> web.Response:
    return web.json_response(error_body(status, message, param), status=status)


def refusal_response(refused: Refused) -> web.Response:
    """The response for a refusal, with ``Retry-After`` when it says when to retry."""
    resp = error_response(HTTP_STATUS[refused.kind], refused.message)
    if refused.retry_after_s is not None:
        resp.headers["Retry-After"] = str(refused.retry_after_s)
    return resp


def refusal_event(refused: Refused) -> dict:
    """The refusal as an event of a stream already sending (its status in ``code``)."""
    return error_body(HTTP_STATUS[refused.kind], refused.message)


@web.middleware
async def internal_errors(request: web.Request, handler) -> web.StreamResponse:
    """aiohttp's own errors (no such route 404, wrong method 405 with ``Allow``, a body
    past its size 413) in OpenAI's shape; an unexpected exception in a handler a 500
    naming an incident id, the traceback in the log only."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        resp = error_response(e.status, f"{request.method} {request.path[:100]}: {e.reason}")
        if "Allow" in e.headers:
            resp.headers["Allow"] = e.headers["Allow"]
        return resp
    except Exception:
        return error_response(500, internal_error(f"{request.method} {request.path}"))


class Reply:
    """OpenAI's response objects for one request. ``logprobs``: the shape of its logprobs
    when it asked for them (every choice then has a logprobs object, else null);
    ``tools``: the model's tool-call format when the request may call tools (its calls
    are parsed out of the text: a whole reply's at once, a stream's content sent as it
    comes and its calls with the last chunk, router/openai_tools.py); ``prompt``: how
    it shows its prompt's logprobs, when it asked (the first object after they arrive
    shows them)."""

    def __init__(
        self,
        request_id: str,
        model: str,
        chat: bool,
        logprobs: LogprobsShape | None = None,
        tools: ToolParser | None = None,
        prompt: PromptReply | None = None,
        index: int = 0,
    ):
        """``index``: which choice of the request this reply's objects show."""
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.index = index
        self.model, self.chat, self.created = model, chat, int(time.time())
        self.logprobs, self.prompt = logprobs, prompt
        self.tools = tools
        self._stream = None if tools is None else ToolStream(tools)

    def _base(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def whole(
        self, text: str, finish_reason: str, usage: dict, logprobs: list[Logprobs] | None = None
    ) -> dict:
        message: dict = {"role": "assistant", "content": text}
        if self.tools is not None:
            content, calls = self.tools.parse(text)
            if calls:
                message = {"role": "assistant", "content": content or None,
                           "tool_calls": calls_json(calls)}  # fmt: skip
                finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        out = self._with_choice(
            "chat.completion", "message", message, text, finish_reason, logprobs
        )
        return {**out, "usage": usage}

    def role_chunk(self) -> dict | None:
        if not self.chat:
            return None
        delta = {"role": "assistant", "content": ""}
        choice = {"index": self.index, "delta": delta, "logprobs": None, "finish_reason": None}
        return {**self._base("chat.completion.chunk"), "choices": [choice]}

    def chunk(
        self, text: str, finish_reason: str | None, logprobs: list[Logprobs] | None = None
    ) -> dict:
        delta: dict = {"content": text}
        if self._stream is not None:
            delta["content"] = self._stream.feed(text)
            if finish_reason is not None:
                rest, calls = self._stream.finish()
                delta["content"] += rest
                if calls:
                    delta["tool_calls"] = calls_json(calls, indexed=True)
                    finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        return self._with_choice(
            "chat.completion.chunk", "delta", delta, text, finish_reason, logprobs
        )

    def _with_choice(
        self, chat_kind: str, chat_key: str, chat_value: dict, text: str, finish_reason, logprobs
    ) -> dict:
        """One object with one choice: chat's (``chat_key``: ``chat_value``) or a plain
        completion's (``text``); ``logprobs``: of the tokens it covers."""
        if self.chat:
            kind, choice = chat_kind, {"index": self.index, chat_key: chat_value}
        else:
            kind, choice = "text_completion", {"index": self.index, "text": text}
        choice["logprobs"] = None
        prompt, echo, listed = self.prompt, None, None
        if prompt is not None:  # the echo's text offsets come before the completion's
            echo, listed = prompt.take_echo(), prompt.vllm_list()
            prompt.pending = None
        if self.logprobs is not None:
            rendered = self.logprobs.render(logprobs or [])
            if echo is not None:
                rendered = {key: echo[key] + rendered[key] for key in rendered}
            choice["logprobs"] = rendered
        choice["finish_reason"] = finish_reason
        out = {**self._base(kind), "choices": [choice]}
        if listed is not None:
            (out if self.chat else choice)["prompt_logprobs"] = listed
        return out

    def usage_chunk(self, usage: dict) -> dict:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._base(kind), "choices": [], "usage": usage}


def usage_object(usage: Usage) -> dict:
    """OpenAI's usage object, with ``prompt_tokens_details.cached_tokens`` (the prompt
    tokens served from a prefix cache) as vLLM's ``--enable-prompt-tokens-details``."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }
