"""The chaos run's load: each request streamed through the router at its arrival time
(open loop), every token kept, so that the stream can be checked against the
expected output afterwards.

A request is ``completed`` when its stream ended with a final message (a
``finish_reason``), ``failed`` when it ended with an error (the gRPC status and
details) or without a final message. ``attempts`` (from the final message's timings)
> 1 means the router moved the request to another instance on the way.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field


@dataclass
class StreamRecord:
    index: int
    prompt_tokens: int
    sent_s: float  # since the load started
    end_s: float | None = None
    token_ids: list[int] = field(default_factory=list)
    chunks: int = 0
    finish_reason: str | None = None
    error: str | None = None
    attempts: int = 0  # from the final message; 0 when there was none
    instances: list[str] = field(default_factory=list)

    @property
    def completed(self) -> bool:
        return self.finish_reason is not None and self.error is None

    def to_dict(self) -> dict:
        return asdict(self)


async def _stream(client, rec: StreamRecord, prompt: list[int], max_tokens: int, timeout_s):
    import grpc

    try:
        async for chunk in client.agenerate(
            prompt_token_ids=prompt,
            max_tokens=max_tokens,
            temperature=0.0,
            ignore_eos=True,
            timeout=timeout_s,
        ):
            rec.token_ids += chunk.token_ids
            rec.chunks += 1
            if chunk.finished:
                rec.finish_reason = chunk.finish_reason
                rec.attempts = chunk.timings.attempts
                rec.instances = list(chunk.timings.instances)
    except grpc.RpcError as e:
        rec.error = f"{e.code().name}: {e.details()}"
    if rec.finish_reason is None and rec.error is None:
        rec.error = "the stream ended without a final message"


async def run_load(
    client,
    prompts: list[list[int]],
    arrivals: list[float],
    max_tokens: int,
    timeout_s: float | None,
    start: float,
    on_progress: Callable[[list[StreamRecord]], None] = lambda records: None,
    progress_every_s: float = 1.0,
) -> list[StreamRecord]:
    """Send ``prompts[i]`` at ``start + arrivals[i]`` (``time.monotonic()`` clock);
    the records in request order once every stream has ended. ``on_progress(records)``
    sees the records sent so far every ``progress_every_s``."""
    records: list[StreamRecord] = []

    async def one(rec: StreamRecord, prompt: list[int]) -> None:
        await _stream(client, rec, prompt, max_tokens, timeout_s)
        rec.end_s = round(time.monotonic() - start, 3)

    async def ticker():
        while True:
            await asyncio.sleep(progress_every_s)
            on_progress(records)

    tick = asyncio.create_task(ticker())
    tasks = []
    try:
        for i, (prompt, at) in enumerate(zip(prompts, arrivals, strict=True)):
            delay = start + at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            rec = StreamRecord(i, len(prompt), round(time.monotonic() - start, 3))
            records.append(rec)
            tasks.append(asyncio.create_task(one(rec, prompt)))
        await asyncio.gather(*tasks)
    finally:
        tick.cancel()
        await client.aclose()
    on_progress(records)
    return records
