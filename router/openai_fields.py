"""Which fields of an OpenAI request body pdserve reads, which it accepts as metadata,
and which it refuses (docs/serving.md, "OpenAI-compatible HTTP API"; docs/openapi.yaml
describes each).

Every top-level key of a body is in exactly one of these tables for its endpoint, or
it is refused as unknown (naming the key), as vLLM's strict mode does:

- ``READ``: parsed by router/openai_request.py into the core's request or the reply;
- ``METADATA``: type-checked and ignored (it changes nothing about the answer);
- ``FIXED``: OpenAI features pdserve does not implement. Each accepts ``null`` and the
  values that ask for what pdserve does anyway (``logit_bias: {}``, ``suffix: ""``); any other value
  is refused with a 400 naming the field, never silently ignored.

The same holds for the keys of one chat message (``MESSAGE_*``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Fixed:
    """An unimplemented field: the non-null values accepted, and why others are not."""

    accepted: tuple
    why: str


_COMMON_READ = (
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "stream",
    "stream_options",
    # beyond OpenAI's fields, as vLLM accepts them
    "top_k",
    "ignore_eos",
    "stop_token_ids",
    "repetition_penalty",
    "prompt_logprobs",
    # choices: n streams, the prompt computed once (docs/serving.md, "Several choices")
    "n",
    # OpenAI's, implemented in the sampler (docs/serving.md, "Log-probabilities and penalties")
    "logprobs",
    "presence_penalty",
    "frequency_penalty",
    # pdserve's own: seconds from arrival until the request ends with 408
    "timeout",
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs
    # (router/openai_guide.py)
    "response_format",
    "structured_outputs",
)
# best_of: the n of best_of choices with the highest mean logprob (not streamed)
COMPLETIONS_READ = frozenset((*_COMMON_READ, "prompt", "echo", "best_of"))
CHAT_READ = frozenset(
    (
        *_COMMON_READ,
        "messages",
        "max_completion_tokens",
        "top_logprobs",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
    )
)

# end-user ids and tags: accepted (a string; an object of strings) and ignored
COMPLETIONS_METADATA = {"user": str}
CHAT_METADATA = {"user": str, "metadata": dict, "safety_identifier": str}

_COMMON_FIXED = {
    "logit_bias": Fixed(({},), "logit bias is not implemented"),
}
COMPLETIONS_FIXED = {
    **_COMMON_FIXED,
    "suffix": Fixed(("",), "insertion (a suffix after the completion) is not implemented"),
}
CHAT_FIXED = {
    **_COMMON_FIXED,
    "functions": Fixed(([],), "function calling is not implemented"),
    "function_call": Fixed(("none",), "function calling is not implemented"),
    "audio": Fixed((), "audio output is not implemented"),
    "modalities": Fixed((["text"],), "only text output is implemented"),
    "prediction": Fixed((), "predicted outputs are not implemented"),
    "store": Fixed((False,), "completions are not stored"),
}

# one chat message: role, content and its tool calls or call id are read; the rest only as
# null or empty
MESSAGE_READ = frozenset(("role", "content", "tool_calls", "tool_call_id"))
MESSAGE_FIXED = {
    "name": Fixed((), "participant names are not passed to the chat template"),
    "function_call": Fixed((), "function calling is not implemented"),
    "audio": Fixed((), "audio is not implemented"),
    "refusal": Fixed((), "refusals are not read"),
}


def fields(chat: bool) -> tuple[frozenset, dict, dict]:
    """The (read, metadata, fixed) tables of an endpoint."""
    if chat:
        return CHAT_READ, CHAT_METADATA, CHAT_FIXED
    return COMPLETIONS_READ, COMPLETIONS_METADATA, COMPLETIONS_FIXED


def same(value, accepted) -> bool:
    """JSON equality: ``true`` is not ``1``, ``1.0`` is ``1``."""
    if isinstance(value, bool) or isinstance(accepted, bool):
        return value is accepted
    if isinstance(accepted, dict):
        return (
            isinstance(value, dict)
            and value.keys() == accepted.keys()
            and all(same(value[k], accepted[k]) for k in accepted)
        )
    if isinstance(accepted, list):
        return (
            isinstance(value, list)
            and len(value) == len(accepted)
            and all(same(v, a) for v, a in zip(value, accepted, strict=True))
        )
    if isinstance(accepted, int | float):
        return isinstance(value, int | float) and value == accepted
    return type(value) is type(accepted) and value == accepted


def model_names(model: str) -> frozenset[str]:
    """The names a request may give the served ``model`` (the config's ``model``): that
    string (the id ``/v1/models`` lists), and the other names of the same checkpoint
    the config accepts: an alias of its file, its file or folder as an absolute path.
    Worked out once, from the config; a request's name is only looked up."""
    from pdserve.engine.checkpoint import ALIASES, alias_path

    def where(name: str) -> Path | None:
        try:
            return (alias_path(name) if name in ALIASES else Path(name).expanduser()).resolve()
        except (OSError, ValueError):
            return None

    served = where(model)
    names = {model} | ({str(served)} if served is not None else set())
    return frozenset(names | {a for a in ALIASES if served is not None and where(a) == served})
