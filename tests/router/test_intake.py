"""Tokenization off the event loop, in arrival order (router/intake.py): the real
``Intake`` and ``RequestValidator`` on its thread pool, with prompts whose tokenization
takes a set time; the loop keeps running meanwhile, a request that finished early waits
for those that arrived before it, and a refused or cancelled one holds nobody up. A
short token-id prompt is checked on the loop, and still waits its turn."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from pdserve.router.intake import INLINE_IDS, Intake
from pdserve.router.request import GenerateRequest, Refused
from pdserve.router.validation import ModelLimits, RequestValidator

CONFIG = dict(
    max_prompt_tokens=8,
    max_stop_strings=2,
    max_stop_string_chars=4,
    max_request_id_chars=16,
    max_grammar_bytes=64,
    tokenizer_threads=2,
)


class TimedValidator(RequestValidator):
    """A text prompt ``"MS ID ID ..."`` takes MS milliseconds to tokenize into
    ``[MS, ID, ...]`` (then checked as token ids are); records the thread that checked
    each prompt, by the prompt (its text, or its number of token ids)."""

    def __init__(self, limits: ModelLimits):
        super().__init__(None, limits)
        self.threads: dict[str | int, str] = {}

    def prompt_ids(self, request: GenerateRequest) -> list[int]:
        prompt = request.prompt if request.prompt is not None else len(request.prompt_token_ids)
        self.threads[prompt] = threading.current_thread().name
        if request.prompt is None:
            return super().prompt_ids(request)
        ids = [int(x) for x in request.prompt.split()]
        time.sleep(ids[0] / 1000)
        return super().prompt_ids(GenerateRequest(prompt_token_ids=ids))


def _request(ms: int, *ids: int) -> GenerateRequest:
    return GenerateRequest(prompt=" ".join(str(x) for x in (ms, *ids)))


def test_requests_leave_the_intake_in_arrival_order_and_the_loop_runs_meanwhile():
    validator = TimedValidator(ModelLimits(max_context=64, vocab_size=1000, kv_tokens=64))

    async def run():
        intake, done, ticks = Intake(CONFIG), [], 0

        async def one(name: str, request: GenerateRequest):
            try:
                await intake.prepare(request, validator)
                done.append(name)
            except Refused:
                done.append(f"{name} refused")

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.005)
                ticks += 1

        tick = asyncio.ensure_future(ticker())
        tasks = [
            asyncio.ensure_future(one("slow", _request(300))),
            asyncio.ensure_future(one("invalid", _request(1, 5000))),  # past the vocabulary
            asyncio.ensure_future(one("long", _request(1, *[5] * 8))),  # past max_prompt_tokens
            asyncio.ensure_future(one("cancelled", _request(1))),
            asyncio.ensure_future(one("fast", _request(1))),
        ]
        await asyncio.sleep(0.1)
        assert done == ["invalid refused", "long refused"]  # at once: nothing to admit
        tasks[3].cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        tick.cancel()
        intake.close()
        return done, ticks

    done, ticks = asyncio.run(run())
    assert done == ["invalid refused", "long refused", "slow", "fast"]
    assert ticks >= 20  # the loop ran through the 0.3 s of tokenization


def test_short_token_id_prompts_are_checked_on_the_loop_and_keep_their_turn():
    validator = TimedValidator(ModelLimits(max_context=2 * INLINE_IDS, vocab_size=1000,
                                           kv_tokens=2 * INLINE_IDS))  # fmt: skip
    config = {**CONFIG, "max_prompt_tokens": None}

    async def run():
        intake, done = Intake(config), []

        async def one(name: str, request: GenerateRequest):
            await intake.prepare(request, validator)
            done.append(name)

        await asyncio.gather(
            one("slow text", _request(200)),
            one("ids", GenerateRequest(prompt_token_ids=[5] * 16)),
            one("long ids", GenerateRequest(prompt_token_ids=[5] * (INLINE_IDS + 1))),
        )
        intake.close()
        return done

    assert asyncio.run(run()) == ["slow text", "ids", "long ids"]
    on_loop = threading.main_thread().name
    assert validator.threads[16] == on_loop  # the short one: on the event loop
    assert validator.threads["200"] != on_loop and validator.threads[INLINE_IDS + 1] != on_loop


def test_the_limits_name_the_key_the_value_and_the_bound():
    intake = Intake(CONFIG)
    try:
        for stop, words in ((["a", "b", "c"], "router.max_stop_strings=2"), (["abcde"], "=4")):
            request = _request(0)
            request.sampling.stop = stop
            with pytest.raises(Refused, match=words):
                intake.check_limits(request)
        validator = RequestValidator(None, ModelLimits(64, 1000, 64))
        with pytest.raises(Refused, match=r"prompt: 9 tokens, past router.max_prompt_tokens=8"):
            asyncio.run(intake.prepare(GenerateRequest(prompt_token_ids=[5] * 9), validator))
    finally:
        intake.close()
