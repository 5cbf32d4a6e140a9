"""What the router core takes and how it says no: ``GenerateRequest`` and ``Refused``.

Both front ends (router/grpc_api.py, router/http_api.py) translate their wire format
into these types and the core's refusals back into their own codes; nothing here
knows either wire format.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pdserve.engine.structured import Guide


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its name, what it does, and the JSON schema of its
    arguments (an object schema)."""

    name: str
    description: str = ""
    parameters: dict = field(default_factory=lambda: {"type": "object"})

    def as_openai(self) -> dict:
        """OpenAI's ``{"type": "function", "function": {...}}``, as chat templates take it."""
        spec = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": spec}


@dataclass(frozen=True)
class ToolCall:
    """One call the model wrote: its id (``call_...``), the function, its arguments (JSON
    text, an object)."""

    id: str
    name: str
    arguments: str


@dataclass
class ChatMessage:
    """``tool_calls``: an assistant's earlier calls; ``tool_call_id``: a ``tool``
    message's answer to one of them."""

    role: str
    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str = ""


@dataclass
class SamplingOptions:
    """Sampling as the client sent it: ``None`` is unset and takes the default of
    ``engine.SamplingParams``; the router's validation checks the values."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # logprobs: alternatives per token (0-20; None: no logprobs); penalties: None is off
    logprobs: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    # what the output must match (structured outputs), and the request's field that
    # asked for it (named when it is refused)
    guide: Guide | None = None
    guide_field: str = "guide"
    # the prompt's logprobs: alternatives per prompt token (0-20; None: none)
    prompt_logprobs: int | None = None
    # choices: sequences generated from the prompt (1-16), choice i seeded seed + i
    n: int = 1


# the fields of SamplingOptions that may be unset (None), as the front ends read them
OPTIONAL_SAMPLING = (
    "max_tokens",
    "temperature",
    "top_k",
    "top_p",
    "seed",
    "logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "prompt_logprobs",
)


@dataclass
class GenerateRequest:
    """One generation request.

    The input is exactly one of ``prompt`` (text, tokenized by the router),
    ``messages`` (rendered with the model's chat template) or ``prompt_token_ids``;
    the others stay ``None``. An empty string or list counts as given (the router
    then says what is empty); none or several given is refused as INVALID.
    ``request_id`` is optional: the router assigns one when it is empty.
    """

    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    prompt_token_ids: list[int] | None = None
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    request_id: str = ""
    # tool calling (chat): the functions the model may call; ``tool_choice``: "none",
    # "auto", "required" or a function's name (the model must call that one);
    # ``parallel_tool_calls``: more than one call in a turn
    tools: list[Tool] = field(default_factory=list)
    tool_choice: str = "none"
    parallel_tool_calls: bool = True

    def inputs_given(self) -> list[str]:
        """The names of the inputs that are set (not ``None``)."""
        return [
            name
            for name in ("prompt", "messages", "prompt_token_ids")
            if getattr(self, name) is not None
        ]


class Refusal(enum.Enum):
    """Why the router will not take a request, or gave up on one it took; each front end
    maps it to its own code (gRPC status, HTTP status)."""

    INVALID = "invalid"  # it can never run as sent: the message names the field
    EXISTS = "exists"  # its request_id is already in flight
    BUSY = "busy"  # overloaded (queue full, waited too long, too many calls): retry later
    UNAVAILABLE = "unavailable"  # loading, draining, or every instance has failed
    DEADLINE = "deadline"  # its deadline passed before it finished


RETRY_AFTER_S = 1  # what a BUSY refusal asks the client to wait before retrying, in seconds


class Refused(Exception):
    """A request the router will not take, or gave up on: the kind of refusal and why.

    ``retry_after_s`` (whole seconds) is set exactly for BUSY (``RETRY_AFTER_S`` unless
    the refusal knows better): the front ends send it as HTTP ``Retry-After`` and gRPC
    trailing metadata ``retry-after``. ``reason``: which bound or check refused it, as
    ``pdserve:requests_refused_total`` counts it (router/metrics.py
    ``REFUSAL_REASONS``); the kind's value unless a BUSY refusal names its bound."""

    def __init__(
        self,
        kind: Refusal,
        message: str,
        retry_after_s: int = RETRY_AFTER_S,
        reason: str | None = None,
    ):
        super().__init__(message)
        self.kind, self.message = kind, message
        self.retry_after_s = retry_after_s if kind is Refusal.BUSY else None
        self.reason = reason or kind.value
