"""Turn a ``GenerateRequest`` (router/request.py) into prompt token ids and sampling
settings, or refuse it.

Runs at the router, before admission, so that a request that can never run is
refused at once (``Refusal.INVALID`` with the reason) instead of failing on an instance.
A text longer than the prompt's room in tokens times the longest token's characters
(``Tokenizer.max_token_chars``) cannot fit however it tokenizes: it is refused from its
length, before the tokenizer reads it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.structured import Grammars, Guide, GuideError, llg_tokenizer
from pdserve.engine.tokenizer import Tokenizer
from pdserve.router.request import OPTIONAL_SAMPLING, ChatMessage, GenerateRequest, Tool
from pdserve.router.tool_parsers import for_template


class InvalidRequest(ValueError):
    """The request cannot run; the message says which field and what is allowed."""


@dataclass
class ModelLimits:
    max_context: int  # prompt + generated tokens an instance can hold
    vocab_size: int
    kv_tokens: int  # tokens the smallest instance's KV cache holds (blocks x block size)
    max_batch_size: int = 256  # requests the smallest instance runs at once (a choice is one)


# the roles a chat message may have (a tool's result: "tool", docs/serving.md "Tool calling")
ROLES = ("system", "developer", "user", "assistant", "tool")
_SEEDS = (-(2**63), 2**63)  # torch's generators take 64-bit seeds
_INT32_MAX = 2**31 - 1


def _integer(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class RequestValidator:
    def __init__(self, tokenizer: Tokenizer | None, limits: ModelLimits):
        self.tokenizer, self.limits = tokenizer, limits
        # the most prompt tokens a request may have: one generated token must fit after
        self.max_prompt_tokens = min(limits.max_context, limits.kv_tokens) - 1
        self.max_token_chars = 0 if tokenizer is None else tokenizer.max_token_chars
        self.tool_parser = for_template(None if tokenizer is None else tokenizer.chat_template)
        self._grammars: Grammars | None = None
        self._grammars_lock = threading.Lock()  # the intake's threads validate at once

    def prompt_ids(self, request: GenerateRequest) -> list[int]:
        given = request.inputs_given()
        if not given:
            raise InvalidRequest("prompt: empty; send prompt, messages or prompt_token_ids")
        if len(given) > 1:
            raise InvalidRequest(
                f"{', '.join(given)}: give exactly one of prompt, messages, prompt_token_ids"
            )
        if request.prompt_token_ids is not None:  # the one input given
            ids = list(request.prompt_token_ids)
            vocab = self.limits.vocab_size
            if ids and (min(ids) < 0 or max(ids) >= vocab):
                raise InvalidRequest(f"prompt_token_ids: token ids must be in [0, {vocab})")
        elif request.messages is not None:
            ids = self._encode(self._render(request.messages, request.tools), "messages")
        else:
            ids = self._encode(request.prompt, "prompt") if request.prompt else []
        if not ids:
            raise InvalidRequest("prompt: empty; give at least one token")
        if len(ids) >= self.limits.max_context:
            raise InvalidRequest(
                f"prompt: {len(ids)} tokens, the context holds {self.limits.max_context} "
                "(the prompt must leave room for one generated token)"
            )
        if len(ids) + 1 > self.limits.kv_tokens:
            raise InvalidRequest(
                f"prompt: {len(ids)} tokens, an instance's KV cache holds "
                f"{self.limits.kv_tokens} tokens"
            )
        return ids

    def sampling(self, request: GenerateRequest) -> SamplingParams:
        s = request.sampling
        kwargs = {name: getattr(s, name) for name in OPTIONAL_SAMPLING}
        kwargs = {name: value for name, value in kwargs.items() if value is not None}
        kwargs["top_k"] = 0 if s.top_k == -1 else kwargs.get("top_k", 0)  # -1: off, as vLLM
        # Integers past what any model can use, which the HTTP API takes unbounded, are
        # brought within the gRPC API's int32 (what the instances' feed carries, at
        # most 64 bits) without changing an output: a top_k or max_tokens past any
        # vocabulary or context is clamped, a stop token id no model can sample dropped.
        for name in ("top_k", "max_tokens"):
            if name in kwargs and _integer(kwargs[name]):
                kwargs[name] = min(kwargs[name], _INT32_MAX)
        vocab = self.limits.vocab_size
        kwargs.update(
            stop=list(s.stop),
            stop_token_ids=[t for t in s.stop_token_ids if not _integer(t) or 0 <= t < vocab],
            ignore_eos=s.ignore_eos,
        )
        if s.seed is not None and not _SEEDS[0] <= s.seed < _SEEDS[1] - max(0, s.n - 1):
            raise InvalidRequest(
                f"sampling.seed={s.seed!r}: must be in [-2**63, 2**63 - n + 1) (choice i "
                f"draws with seed + i; n={s.n!r})"
            )
        kwargs["n"] = s.n
        if _integer(s.n) and s.n > self.limits.max_batch_size:
            raise InvalidRequest(
                f"sampling.n={s.n}: more choices than an instance runs at once "
                f"(max_batch_size={self.limits.max_batch_size})"
            )
        if s.n != 1 and s.prompt_logprobs is not None:
            raise InvalidRequest(
                f"sampling.n={s.n!r}: prompt logprobs come with one choice; n must be 1"
            )
        guide, field = s.guide, s.guide_field
        if request.tools:
            forced = self._tool_guide(request)
            if forced is not None and guide is not None:
                raise InvalidRequest(
                    f"tool_choice={request.tool_choice!r} and {field}: both ask for the "
                    "output's form; give one"
                )
            guide, field = (forced, "tool_choice") if forced is not None else (guide, field)
        if guide is not None:
            try:
                self.grammars(field).compile(guide)
            except GuideError as e:
                raise InvalidRequest(f"{field}: {e}") from e
            kwargs["guide"] = guide
        try:
            return SamplingParams(**kwargs)
        except ValueError as e:
            raise InvalidRequest(f"sampling.{e}") from e

    def _tool_guide(self, request: GenerateRequest) -> Guide | None:
        """The guide ``tool_choice`` asks for: calls of the tools ("required") or of the
        one named, in the model's format (router/tool_parsers.py); None for "auto" and
        "none". Every tool's schema is compiled, whatever the choice."""
        tools, choice = request.tools, request.tool_choice
        names = [t.name for t in tools]
        if choice not in ("none", "auto", "required") and choice not in names:
            raise InvalidRequest(f"tool_choice: function {choice!r} is not in tools {names}")
        parallel = request.parallel_tool_calls
        calls = Guide("grammar", self.tool_parser.grammar(tools, None, parallel))
        try:
            self.grammars("tools").compile(calls)
        except GuideError as e:
            raise InvalidRequest(f"tools: a function's parameters do not compile: {e}") from e
        if choice == "required":
            return calls
        if choice in names:
            return Guide("grammar", self.tool_parser.grammar(tools, choice, parallel))
        return None

    def grammars(self, field: str) -> Grammars:
        """The guides compiled with the model's tokenizer, as the instances compile them
        (built at the first guided request)."""
        if self.tokenizer is None:
            raise InvalidRequest(f"{field}: this model has no tokenizer to match a grammar with")
        with self._grammars_lock:
            if self._grammars is None:
                vocab = self.limits.vocab_size
                self._grammars = Grammars(llg_tokenizer(self.tokenizer, vocab))
            return self._grammars

    def _encode(self, text: str, field: str) -> list[int]:
        """``text``'s token ids; a text so long that no tokenization of it fits the
        prompt's room (``max_prompt_tokens``) is refused first, from its length alone."""
        if self.tokenizer is None:
            raise InvalidRequest(f"{field}: this model has no tokenizer; send prompt_token_ids")
        room, per_token = self.max_prompt_tokens, self.max_token_chars
        if len(text) > room * per_token:
            raise InvalidRequest(
                f"{field}: {len(text)} characters, more than {room} tokens of at most "
                f"{per_token} characters each can hold (the context holds "
                f"{self.limits.max_context} tokens, an instance's KV cache "
                f"{self.limits.kv_tokens}); refused before tokenization"
            )
        return self.tokenizer.encode(text)

    def _render(self, messages: list[ChatMessage], tools: list[Tool]) -> str:
        if not messages:
            raise InvalidRequest("messages: empty; give at least one message")
        for i, m in enumerate(messages):
            if m.role not in ROLES:
                raise InvalidRequest(
                    f"messages[{i}].role={m.role[:40]!r}: must be one of {', '.join(ROLES)}"
                )
        if self.tokenizer is None:
            raise InvalidRequest("messages: this model has no tokenizer; send prompt_token_ids")
        chat: list[dict] = [{"role": m.role, "content": m.content} for m in messages]
        functions = None
        if tools or any(m.tool_calls or m.role == "tool" for m in messages):
            takes = self.tokenizer.takes_tools
            chat, functions = self.tool_parser.template_inputs(messages, tools, takes)
        try:
            return self.tokenizer.apply_chat_template(chat, tools=functions)
        except Exception as e:  # any: the template is code run on the request's messages
            raise InvalidRequest(_template_error(e)) from e


def _template_error(error: Exception) -> str:
    """A chat template's failure on a request's messages, in one short line: its own
    ``raise_exception`` text, or the kind of error (jinja2's undefined names, type
    errors, sandbox refusals, recursion) and its first line."""
    text = str(error).strip()
    text = text.splitlines()[0][:200] if text else ""
    if isinstance(error, ValueError) and text.startswith(("messages:", "chat template:")):
        return text  # the tokenizer's own, and the template's raise_exception
    return f"messages: the chat template failed on them ({type(error).__name__}: {text})"
