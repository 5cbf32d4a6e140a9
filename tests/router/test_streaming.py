"""Streaming through a real cluster: offline equality, both instances used, no leaks,
and cancellation that frees blocks at once."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from pdserve.engine import LLM, SamplingParams
from tests.cluster.helpers import all_blocks_free, wait_until


@pytest.fixture(scope="module")
def offline(chat_model):
    return LLM(chat_model)


def _workload(n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """Mixed prompt lengths (1-300 tokens) and output lengths (1-48 tokens)."""
    rng = random.Random(seed)
    return [
        (
            [rng.randrange(3, 256) for _ in range(rng.choice([1, 5, 17, 64, 150, 300]))],
            rng.randint(1, 48),
        )
        for _ in range(n)
    ]


def test_32_concurrent_streams_equal_offline_greedy(cluster, client, offline):
    work = _workload(32)
    before = {i.name: i.requests_total for i in client.stats().instances}

    async def one(ids, max_tokens):
        chunks = []
        async for chunk in client.agenerate(
            prompt_token_ids=ids, max_tokens=max_tokens, temperature=0, ignore_eos=True
        ):
            chunks.append(chunk)
        return chunks

    async def run_all():
        try:
            return await asyncio.gather(*(one(ids, m) for ids, m in work))
        finally:
            await client.aclose()

    streams = asyncio.run(run_all())
    expected = offline.generate(
        [ids for ids, _ in work],
        [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in work],
    )
    for (ids, max_tokens), chunks, want in zip(work, streams, expected, strict=True):
        got = [t for c in chunks for t in c.token_ids]
        assert got == want.token_ids
        assert "".join(c.text for c in chunks) == want.text
        last = chunks[-1]
        assert last.finish_reason == "length" and all(not c.finished for c in chunks[:-1])
        assert (last.prompt_tokens, last.completion_tokens) == (len(ids), max_tokens)
        t = last.timings
        assert 0 < t.ttft_ms <= t.e2e_ms and t.queue_ms <= t.ttft_ms
        assert t.tpot_ms > 0 if max_tokens > 1 else t.tpot_ms == 0
        assert len(t.instances) == 1 and t.instances[0].startswith("colocated-")
    stats = client.stats()
    used = {i.name: i.requests_total - before[i.name] for i in stats.instances}
    assert sum(used.values()) == 32 and all(n > 0 for n in used.values()), used
    assert all_blocks_free(stats), stats
    assert all(i.tokens_total > 0 and i.steps_total > 0 for i in stats.instances)


def test_chat_and_text_prompts_are_tokenized_at_the_router(client, offline):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    done = client.complete(messages=messages, max_tokens=12, temperature=0, ignore_eos=True)
    prompt = offline.tokenizer.apply_chat_template(messages)
    want = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert done.token_ids == want[0].token_ids
    assert done.prompt_tokens == len(offline.tokenizer.encode(prompt))
    text = client.complete("Hello", max_tokens=5, temperature=0, ignore_eos=True)
    assert text.prompt_tokens == 5 and len(text.token_ids) == 5


def _long_stream_started(client, **kw):
    stream = client.generate(
        prompt_token_ids=list(range(3, 103)), max_tokens=900, ignore_eos=True, **kw
    )
    for _ in range(3):
        assert not next(stream).finished
    stats = client.stats()
    assert stats.in_flight == 1 and not all_blocks_free(stats)
    return stream


def test_cancel_midway_frees_blocks_within_a_second(client):
    stream = _long_stream_started(client)
    t0 = time.monotonic()
    stream.cancel()
    assert wait_until(lambda: all_blocks_free(client.stats()), timeout_s=1.0)
    assert time.monotonic() - t0 < 1.0


def test_leaving_the_loop_cancels(client):
    for chunk in client.generate(
        prompt_token_ids=list(range(3, 103)), max_tokens=900, ignore_eos=True
    ):
        assert chunk.token_ids
        break
    t0 = time.monotonic()
    assert wait_until(lambda: all_blocks_free(client.stats()), timeout_s=1.0)
    assert time.monotonic() - t0 < 1.0


def test_async_stream_left_early_cancels(client):
    async def main():
        try:
            async for chunk in client.agenerate(
                prompt_token_ids=list(range(3, 103)), max_tokens=900, ignore_eos=True
            ):
                assert chunk.token_ids
                break
        finally:
            await client.aclose()

    asyncio.run(main())
    assert wait_until(lambda: all_blocks_free(client.stats()), timeout_s=1.0)


def test_abort_by_request_id_ends_the_stream(client):
    stream = _long_stream_started(client, request_id="abort-me")
    assert stream.request_id == "abort-me"
    assert client.abort("abort-me")
    rest = list(stream)
    assert rest[-1].finish_reason == "abort"
    assert wait_until(lambda: all_blocks_free(client.stats()), timeout_s=1.0)
    assert not client.abort("abort-me")
