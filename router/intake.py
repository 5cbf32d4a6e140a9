"""A request's way in, before admission: the router's limits on it, then tokenization
and chat-template rendering on a thread pool, handed back in arrival order
(docs/serving.md, "Authentication, TLS and limits").

``Intake.prepare`` is what ``RouterCore.open_stream`` awaits before it admits.

Invariants:
- The event loop never tokenizes or renders a template: ``RequestValidator.prompt_ids``
  and ``sampling`` run on ``router.tokenizer_threads`` threads, several requests at once.
  A request given as token ids, at most ``INLINE_IDS`` of them and without a guide
  (a grammar compiles on a thread), has nothing to tokenize: it is checked on the loop
  (a range check, microseconds), which spares it two thread hops.
- Requests reach admission in the order they called ``prepare``: each waits, once
  its own work is done, for the one that called before it (that one admitted, refused,
  or gone), and its caller admits with no ``await`` in between, so a short prompt never
  overtakes a long one that arrived first. A caller cancelled while it waits passes its
  turn on only when the one before it has passed its own.
- The limits are refused with INVALID naming the key, the value and the bound:
  ``router.max_request_id_chars``, ``router.max_stop_strings``,
  ``router.max_stop_string_chars`` and ``router.max_grammar_bytes`` first, on the loop
  (cheap), a text too long for any tokenization to fit before it is tokenized
  (router/validation.py), a guide that does not compile on the thread,
  ``router.max_prompt_tokens`` once the prompt is tokenized.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.request import GenerateRequest, Refusal, Refused
from pdserve.router.validation import InvalidRequest, RequestValidator

INLINE_IDS = 4096  # token-id prompts up to this length are checked on the event loop


class Intake:
    def __init__(self, router_config: dict):
        self.max_prompt_tokens: int | None = router_config["max_prompt_tokens"]
        self.max_stop_strings: int = router_config["max_stop_strings"]
        self.max_stop_string_chars: int = router_config["max_stop_string_chars"]
        self.max_request_id_chars: int = router_config["max_request_id_chars"]
        self.max_grammar_bytes: int = router_config["max_grammar_bytes"]
        self._pool = ThreadPoolExecutor(
            router_config["tokenizer_threads"], thread_name_prefix="router-tokenize"
        )
        self._last: asyncio.Future | None = None  # the turn of the latest caller

    async def prepare(
        self, request: GenerateRequest, validator: RequestValidator
    ) -> tuple[list[int], SamplingParams]:
        """The request's prompt ids and sampling settings, in arrival order; raises
        ``Refused`` (INVALID) for a request past a limit or that cannot run."""
        self.check_limits(request)
        loop = asyncio.get_running_loop()
        before, mine = self._last, loop.create_future()
        self._last = mine
        try:
            given = request.prompt_token_ids
            if given is not None and len(given) <= INLINE_IDS and request.sampling.guide is None:
                ids, params = _validate(validator, request)
            else:
                ids, params = await loop.run_in_executor(self._pool, _validate, validator, request)
            bound = self.max_prompt_tokens
            if bound is not None and len(ids) > bound:
                raise Refused(
                    Refusal.INVALID,
                    f"prompt: {len(ids)} tokens, past router.max_prompt_tokens={bound}",
                )
            if before is not None and not before.done():
                await asyncio.shield(before)
            return ids, params
        finally:
            _pass_on(before, mine)

    def check_limits(self, request: GenerateRequest) -> None:
        chars = len(request.request_id)
        if chars > self.max_request_id_chars:
            raise Refused(
                Refusal.INVALID,
                f"request_id: {chars} characters, past router.max_request_id_chars="
                f"{self.max_request_id_chars}",
            )
        stop = request.sampling.stop
        if len(stop) > self.max_stop_strings:
            raise Refused(
                Refusal.INVALID,
                f"stop: {len(stop)} stop strings, past router.max_stop_strings="
                f"{self.max_stop_strings}",
            )
        for i, s in enumerate(stop):
            if len(s) > self.max_stop_string_chars:
                raise Refused(
                    Refusal.INVALID,
                    f"stop[{i}]: {len(s)} characters, past router.max_stop_string_chars="
                    f"{self.max_stop_string_chars}",
                )

        guide, field = request.sampling.guide, request.sampling.guide_field
        if guide is not None and (size := len(guide.spec.encode())) > self.max_grammar_bytes:
            raise Refused(
                Refusal.INVALID,
                f"{field}: {size} bytes of {guide.kind} spec, past router.max_grammar_bytes="
                f"{self.max_grammar_bytes}",
            )

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _validate(
    validator: RequestValidator, request: GenerateRequest
) -> tuple[list[int], SamplingParams]:
    try:
        return validator.prompt_ids(request), validator.sampling(request)
    except InvalidRequest as e:
        raise Refused(Refusal.INVALID, str(e)) from e


def _pass_on(before: asyncio.Future | None, mine: asyncio.Future) -> None:
    """The next caller's turn: now, or when the one before this one passes its own."""

    def done(_=None) -> None:
        if not mine.done():
            mine.set_result(None)

    if before is None or before.done():
        done()
    else:
        before.add_done_callback(done)
