"""An OpenAI request body (``/v1/completions``, ``/v1/chat/completions``) as the core's
``GenerateRequest`` (router/request.py): JSON shapes and types are checked here, values
by the core (router/validation.py). A body of the wrong shape raises ``BadRequest``,
whose message names the field, the value and what is allowed (a 400 in OpenAI's shape).
"""

from __future__ import annotations

import math

from engine.sampling_params import MAX_LOGPROBS
from router.request import ChatMessage, GenerateRequest, SamplingOptions

CHAT_MAX_TOKENS = 512  # when a chat request sets no limit


class BadRequest(Exception):
    pass


def generate_request(body: dict, chat: bool) -> GenerateRequest:
    """An OpenAI request body as the core's ``GenerateRequest``; raises ``BadRequest``
    for a body of the wrong shape or JSON types."""
    if not isinstance(body, dict):
        raise BadRequest(f"the body must be a JSON object, got {type(body).__name__}")
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
        **logprobs_and_penalties(body, chat),
    )
    return req


def logprobs_and_penalties(body: dict, chat: bool) -> dict:
    """The body's logprobs and penalty fields as ``SamplingOptions`` keywords (None:
    unset). Completions: ``logprobs``, an integer (alternatives per token). Chat:
    ``logprobs``, a boolean, and ``top_logprobs``, an integer in [0, MAX_LOGPROBS] that
    needs ``logprobs: true``. Penalties: ``presence_penalty``, ``frequency_penalty``
    (OpenAI's) and ``repetition_penalty`` (vLLM's), numbers; the core checks ranges."""
    if chat:
        wanted = body.get("logprobs")
        if wanted is not None and not isinstance(wanted, bool):
            raise BadRequest(
                f"logprobs={wanted!r}: must be a boolean in chat completions "
                "(top_logprobs says how many alternatives)"
            )
        top = _number("top_logprobs", body.get("top_logprobs"), integer=True)
        if top is not None and not wanted:
            raise BadRequest(f"top_logprobs={top!r}: needs logprobs: true")
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise BadRequest(f"top_logprobs={top!r}: must be an integer in [0, {MAX_LOGPROBS}]")
        logprobs = (top or 0) if wanted else None
    else:
        logprobs = _number("logprobs", body.get("logprobs"), integer=True)
    penalties = ("presence_penalty", "frequency_penalty", "repetition_penalty")
    return {
        "logprobs": logprobs,
        **{key: _number(key, body.get(key), integer=False) for key in penalties},
    }


def _messages(messages) -> list[ChatMessage]:
    if not isinstance(messages, list):
        raise BadRequest("messages: a list of {role, content} is required")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise BadRequest(f"messages[{i}]: must be an object with role and content")
        content = m.get("content") or ""
        if isinstance(content, list):  # content parts: keep the text ones
            if not all(isinstance(p, dict) and isinstance(p.get("text", ""), str) for p in content):
                raise BadRequest(f"messages[{i}].content: parts must be objects with a text")
            content = "".join(p.get("text", "") for p in content if p.get("type") == "text")
        if not isinstance(content, str):
            raise BadRequest(
                f"messages[{i}].content={content!r}: must be a string or a list of parts"
            )
        out.append(ChatMessage(str(m.get("role", "user")), content))
    return out


def timeout_s(body: dict) -> float | None:
    """The body's ``timeout`` (seconds, a positive finite number); None: unset."""
    value = body.get("timeout")
    if value is None:
        return None
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or value <= 0:
        raise BadRequest(f"timeout={value!r}: must be a positive finite number of seconds")
    return float(value)


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
