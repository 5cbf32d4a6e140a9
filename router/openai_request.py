"""An OpenAI request body (``/v1/completions``, ``/v1/chat/completions``) as the core's
``GenerateRequest`` (router/request.py) and what the reply needs (``OpenAIRequest``).

The bytes must be one JSON object (RFC 8259: UTF-8, no NaN or Infinity, nesting
Python's parser can follow); its keys are read, accepted as metadata or refused as
router/openai_fields.py says; JSON shapes and types are checked here, values by the
core (router/validation.py). Anything else raises ``BadRequest``, whose message names
the field, the value (shortened) and what is allowed: a 400 in OpenAI's shape.
"""

from __future__ import annotations

import json
import math
import reprlib
from dataclasses import dataclass
from typing import Literal, overload

from pdserve.engine.sampling_params import MAX_CHOICES, MAX_LOGPROBS
from pdserve.router.openai_fields import MESSAGE_FIXED, MESSAGE_READ, fields, same
from pdserve.router.openai_guide import BadGuide, read_guide
from pdserve.router.openai_tools import BadTools, message_calls, read_tools
from pdserve.router.request import ChatMessage, GenerateRequest, SamplingOptions

CHAT_MAX_TOKENS = 512  # when a chat request sets no limit

_SHOW = reprlib.Repr()  # values in messages: short and shallow, whatever a body holds
_SHOW.maxlevel, _SHOW.maxstring, _SHOW.maxother, _SHOW.maxlist, _SHOW.maxdict = 2, 40, 40, 4, 4


class BadRequest(Exception):
    """A body pdserve cannot read; ``param``: the field at fault (None: the whole body)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message, self.param = message, param


@dataclass
class OpenAIRequest:
    """One body, read: the core's request and how to answer it."""

    request: GenerateRequest
    model: str | None  # None: not given (the served model)
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    echo: bool  # completions: the prompt's text comes before the completion
    timeout_s: float | None  # None: no deadline
    # vLLM's prompt_logprobs: the reply's prompt_logprobs with this many alternatives
    # per prompt token (None: not asked; echo with logprobs puts them in ``logprobs``)
    prompt_logprobs: int | None = None
    # completions' best_of past n: the request generates best_of choices (sampling.n) and
    # the reply holds the n of them with the highest mean logprob per token
    # (router/http_choices.py); None: every choice generated is returned
    best_of_keep: int | None = None
    # whether the reply shows each token's logprobs: False where only best_of asked the
    # engine for them (logprobs 0, to rank the choices)
    show_logprobs: bool = True


def show(value) -> str:
    """``value`` for a message: its repr, shortened in length and depth."""
    return _SHOW.repr(value)


def parse_body(raw: bytes) -> dict:
    """The JSON object in ``raw``."""
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except RecursionError:
        raise BadRequest("the body is nested too deeply to read as JSON") from None
    except UnicodeDecodeError as e:
        raise BadRequest(f"the body is not UTF-8 ({e.reason} at byte {e.start})") from None
    except ValueError as e:
        raise BadRequest(f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"the body must be a JSON object, got a JSON {_kind(body)}")
    return body


def requested_model(body: dict) -> str | None:
    """The body's ``model``; None when it is absent or null."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest(f"model={show(model)}: must be a string, a model's id", "model")
    return model


def read_request(body: dict, chat: bool) -> OpenAIRequest:
    """Read an OpenAI body; raises ``BadRequest`` (the body was parsed by ``parse_body``)."""
    _check_keys(body, chat)
    req = GenerateRequest()
    if chat:
        req.messages = _messages(body.get("messages"))
        try:
            req.tools, req.tool_choice, req.parallel_tool_calls = read_tools(body)
        except BadTools as e:
            raise BadRequest(str(e), e.param) from None
    else:
        req.prompt, req.prompt_token_ids = _prompt(body.get("prompt"))
    limit = max_tokens = _number(body, "max_tokens", integer=True)
    if chat and (completion := _number(body, "max_completion_tokens", integer=True)) is not None:
        limit = completion  # it wins; the value it overrides must still be one
        if max_tokens is not None and max_tokens < 1:
            raise BadRequest(f"max_tokens={max_tokens}: must be an integer >= 1", "max_tokens")
    if limit is None and chat:
        limit = CHAT_MAX_TOKENS
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else [] if stop is None else stop
    if not isinstance(stop, list) or not all(isinstance(x, str) for x in stop):
        raise BadRequest(f"stop={show(stop)}: must be a string or a list of strings", "stop")
    stop_token_ids = body.get("stop_token_ids")
    stop_token_ids = [] if stop_token_ids is None else stop_token_ids
    if not isinstance(stop_token_ids, list) or not all(_is_int(t) for t in stop_token_ids):
        raise BadRequest(
            f"stop_token_ids={show(stop_token_ids)}: must be a list of integers", "stop_token_ids"
        )
    req.sampling = SamplingOptions(
        max_tokens=limit,
        temperature=_number(body, "temperature", integer=False),
        top_k=_number(body, "top_k", integer=True),
        top_p=_number(body, "top_p", integer=False),
        seed=_number(body, "seed", integer=True),
        stop=[_text(s, "stop") for s in stop],
        stop_token_ids=stop_token_ids,
        ignore_eos=_flag(body, "ignore_eos"),
        **logprobs_and_penalties(body, chat),
    )
    n = _number(body, "n", integer=True)
    req.sampling.n = 1 if n is None else n
    stream = _flag(body, "stream")
    try:
        req.sampling.guide, req.sampling.guide_field = read_guide(body)
    except BadGuide as e:
        raise BadRequest(str(e), e.param) from None
    echo = False if chat else _flag(body, "echo")
    # the prompt's logprobs: vLLM's field, and echo with logprobs (OpenAI's legacy form);
    # the engine computes the larger number of alternatives, each reply shows its own
    prompt_logprobs = _number(body, "prompt_logprobs", integer=True)
    if prompt_logprobs is not None and not 0 <= prompt_logprobs <= MAX_LOGPROBS:
        raise BadRequest(
            f"prompt_logprobs={prompt_logprobs!r}: must be an integer in [0, {MAX_LOGPROBS}]",
            "prompt_logprobs",
        )
    asked = (prompt_logprobs, req.sampling.logprobs if echo else None)
    wanted = [n for n in asked if n is not None]
    req.sampling.prompt_logprobs = max(wanted) if wanted else None
    keep, show_logprobs = None, True
    best_of = None if chat else _number(body, "best_of", integer=True)
    if best_of is not None and best_of != req.sampling.n:
        keep, show_logprobs = _best_of(best_of, req.sampling, stream)
    return OpenAIRequest(
        request=req,
        model=requested_model(body),
        stream=stream,
        include_usage=_include_usage(body.get("stream_options")),
        echo=echo,
        timeout_s=_timeout(body.get("timeout")),
        prompt_logprobs=prompt_logprobs,
        best_of_keep=keep,
        show_logprobs=show_logprobs,
    )


def _best_of(best_of: int, sampling: SamplingOptions, stream: bool) -> tuple[int, bool]:
    """Completions' ``best_of`` past ``n`` (OpenAI's: best_of choices generated, the n
    with the highest log probability per token returned, not streamed): ``sampling``
    now asks for best_of choices, with each token's logprob (``logprobs`` 0 unless more
    were asked). Returns the n to keep and whether the reply shows logprobs."""
    n = sampling.n
    if not 1 <= n <= MAX_CHOICES:
        raise BadRequest(f"n={n!r}: must be an integer in [1, {MAX_CHOICES}]", "n")
    if not n < best_of <= MAX_CHOICES:
        raise BadRequest(
            f"best_of={best_of!r}: must be an integer in [n, {MAX_CHOICES}] (n={n!r})", "best_of"
        )
    if stream:
        raise BadRequest(
            f"best_of={best_of!r}: choices kept from more than n={n!r} cannot be streamed "
            "(stream must be false)",
            "best_of",
        )
    if sampling.prompt_logprobs is not None:
        raise BadRequest(
            f"best_of={best_of!r}: prompt logprobs (prompt_logprobs, or echo with "
            "logprobs) come with one choice; best_of must be n",
            "best_of",
        )
    shown = sampling.logprobs is not None
    sampling.n, sampling.logprobs = best_of, sampling.logprobs if shown else 0
    return n, shown


def _check_keys(body: dict, chat: bool) -> None:
    read, metadata, fixed = fields(chat)
    for key, value in body.items():
        known = key in read or key in metadata or key in fixed
        if known and (key in read or value is None):
            continue
        if key in metadata:
            kind = metadata[key]
            ok = isinstance(value, kind) and (
                kind is not dict or all(isinstance(v, str) for v in value.values())
            )
            if not ok:
                what = "a string" if kind is str else "an object of strings"
                raise BadRequest(f"{key}={show(value)}: must be {what} (metadata)", key)
        elif key in fixed:
            _check_fixed(key, value, fixed[key])
        else:
            endpoint = "/v1/chat/completions" if chat else "/v1/completions"
            raise BadRequest(
                f"{key}: unknown field of {endpoint}; docs/openapi.yaml lists the fields", key
            )


def _check_fixed(key: str, value, fixed) -> None:
    if any(same(value, a) for a in fixed.accepted):
        return
    allowed = " or ".join(["null", *(json.dumps(a) for a in fixed.accepted)])
    raise BadRequest(f"{key}={show(value)}: not supported ({fixed.why}); allowed: {allowed}", key)


def _prompt(prompt) -> tuple[str | None, list[int] | None]:
    """(text, None) or (None, token ids)."""
    if isinstance(prompt, list) and len(prompt) == 1 and not _is_int(prompt[0]):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return _text(prompt, "prompt"), None
    if isinstance(prompt, list) and all(_is_int(t) for t in prompt):
        return None, prompt
    if prompt is None:
        raise BadRequest("prompt: required; one string or one list of token ids", "prompt")
    raise BadRequest(
        f"prompt={show(prompt)}: one string or one list of token ids per request", "prompt"
    )


def logprobs_and_penalties(body: dict, chat: bool) -> dict:
    """The body's logprobs and penalty fields as ``SamplingOptions`` keywords (None:
    unset). Completions: ``logprobs``, an integer (alternatives per token). Chat:
    ``logprobs``, a boolean, and ``top_logprobs``, an integer in [0, MAX_LOGPROBS] that
    needs ``logprobs: true``. Penalties: ``presence_penalty``, ``frequency_penalty``
    (OpenAI's) and ``repetition_penalty`` (vLLM's), numbers; the core checks ranges."""
    if chat:
        wanted = _flag(body, "logprobs")
        top = _number(body, "top_logprobs", integer=True)
        if top is not None and not wanted:
            raise BadRequest(f"top_logprobs={top!r}: needs logprobs: true", "top_logprobs")
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise BadRequest(
                f"top_logprobs={top!r}: must be an integer in [0, {MAX_LOGPROBS}]", "top_logprobs"
            )
        logprobs = (top or 0) if wanted else None
    else:
        logprobs = _number(body, "logprobs", integer=True)
    penalties = ("presence_penalty", "frequency_penalty", "repetition_penalty")
    return {"logprobs": logprobs, **{k: _number(body, k, integer=False) for k in penalties}}


def _messages(messages) -> list[ChatMessage]:
    if not isinstance(messages, list):
        raise BadRequest(
            f"messages={show(messages)}: a list of {{role, content}} is required", "messages"
        )
    return [_message(i, m) for i, m in enumerate(messages)]


def _message(i: int, m) -> ChatMessage:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise BadRequest(f"{where}={show(m)}: must be an object with role and content", where)
    for key, value in m.items():
        if key not in MESSAGE_READ and key not in MESSAGE_FIXED:
            raise BadRequest(f"{where}.{key}: unknown field of a message", f"{where}.{key}")
        if key in MESSAGE_FIXED and value is not None:
            _check_fixed(f"{where}.{key}", value, MESSAGE_FIXED[key])
    role = m.get("role")  # which roles: the core's (router/validation.py)
    if not isinstance(role, str):
        raise BadRequest(f"{where}.role={show(role)}: must be a string", f"{where}.role")
    content = m.get("content")
    if isinstance(content, list):  # content parts: text only
        for j, part in enumerate(content):
            if not (
                isinstance(part, dict)
                and part.get("type") == "text"
                and part.keys() <= {"type", "text"}
                and isinstance(part.get("text"), str)
            ):
                raise BadRequest(
                    f"{where}.content[{j}]={show(part)}: only text parts "
                    '({"type": "text", "text": ...}) are implemented',
                    f"{where}.content",
                )
        content = "".join(p["text"] for p in content)
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise BadRequest(
            f"{where}.content={show(content)}: must be a string or a list of text parts",
            f"{where}.content",
        )
    call_id = m.get("tool_call_id") or ""
    if not isinstance(call_id, str):
        raise BadRequest(f"{where}.tool_call_id: must be a string", f"{where}.tool_call_id")
    try:
        calls = message_calls(where, m.get("tool_calls"))
    except BadTools as e:
        raise BadRequest(str(e), e.param) from None
    text = _text(content, f"{where}.content")
    return ChatMessage(_text(role, f"{where}.role"), text, calls, _text(call_id, where))


def _text(value: str, key: str) -> str:
    """A string that is Unicode text: JSON's escapes can spell lone surrogates."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = ord(value[e.start])
        raise BadRequest(f"{key}: holds a lone surrogate (U+{bad:04X}), not text", key) from None
    return value


def _include_usage(options) -> bool:
    if options is None:
        return False
    if not isinstance(options, dict) or not options.keys() <= {"include_usage"}:
        raise BadRequest(
            f"stream_options={show(options)}: must be an object with only include_usage",
            "stream_options",
        )
    return _flag(options, "include_usage", "stream_options.include_usage")


def _timeout(value) -> float | None:
    """``timeout`` (seconds, a positive finite number); None: unset."""
    if value is None:
        return None
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or not math.isfinite(_float(value, "timeout")) or value <= 0:
        raise BadRequest(
            f"timeout={show(value)}: must be a positive finite number of seconds", "timeout"
        )
    return float(value)


def _flag(body: dict, key: str, name: str | None = None) -> bool:
    value = body.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(f"{name or key}={show(value)}: must be true or false", name or key)
    return value


@overload
def _number(body: dict, key: str, integer: Literal[True]) -> int | None: ...
@overload
def _number(body: dict, key: str, integer: Literal[False]) -> float | None: ...
def _number(body: dict, key: str, integer: bool) -> int | float | None:
    """A JSON number for ``key`` as the core takes it (floats as float); None: unset."""
    value = body.get(key)
    if value is None:
        return None
    if integer and not _is_int(value):
        raise BadRequest(f"{key}={show(value)}: must be an integer", key)
    if not integer and (isinstance(value, bool) or not isinstance(value, int | float)):
        raise BadRequest(f"{key}={show(value)}: must be a number", key)
    return value if integer else _float(value, key)


def _float(value: int | float, key: str) -> float:
    try:
        return float(value)
    except OverflowError:  # an integer past float's range
        raise BadRequest(f"{key}={show(value)}: too large for a number", key) from None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number (RFC 8259 has no NaN or Infinity)")


def _kind(value) -> str:
    kinds = {list: "array", str: "string", bool: "boolean", type(None): "null"}
    return kinds.get(type(value), "number")
