"""Open-loop replay: send each request at its arrival time, whether or not the earlier
ones finished, and record what the client saw.

A client is either the router's (``router.client.RouterClient``: times from the
router's final message) or anything with ``async fill(record, request, timeout_s)``
that fills a ``Record`` itself (``loadgen.endpoint.EndpointClient``: times measured at
the client). Both have ``aclose()``, called at the end of each replay.
"""

from __future__ import annotations

import asyncio
import sys
import time

from pdserve.loadgen.metrics import Record
from pdserve.loadgen.workloads import Request


async def from_router(
    client, rec: Record, prompt_ids: list[int], output_len: int, timeout_s: float | None
) -> list[int] | None:
    """Send one request through the router and fill ``rec`` from its final message;
    the answer's token ids, None when it failed (``rec.error`` says why)."""
    import grpc

    try:
        done = await client.acomplete(
            prompt_token_ids=prompt_ids,
            max_tokens=output_len,
            temperature=0.0,
            ignore_eos=True,
            timeout=timeout_s,
        )
    except grpc.RpcError as e:
        rec.error = f"{e.code().name}: {e.details()}"
        return None
    rec.finish_reason, rec.completion_tokens = done.finish_reason, done.completion_tokens
    t = done.timings
    if t is None:
        rec.error = "the stream ended without a final message"
        return None
    rec.ttft_ms, rec.tpot_ms, rec.e2e_ms, rec.queue_ms = t.ttft_ms, t.tpot_ms, t.e2e_ms, t.queue_ms
    rec.instances, rec.kv_bytes, rec.transfer_ms = list(t.instances), t.kv_bytes, t.transfer_ms
    rec.kv_cached_tokens = t.kv_cached_tokens
    rec.phases = {k: v for k, v in t.phases.items() if k != "tokens"}
    rec.cached_tokens = done.cached_tokens
    return list(done.token_ids)


async def _one(client, index: int, req: Request, start: float, timeout_s: float | None):
    sent = time.monotonic() - start
    rec = Record(
        index, sent, len(req.prompt_token_ids), req.output_len, lag_ms=(sent - req.arrival_s) * 1e3
    )
    fill = getattr(client, "fill", None)
    if fill is not None:
        await fill(rec, req, timeout_s)
    else:
        await from_router(client, rec, req.prompt_token_ids, req.output_len, timeout_s)
    return rec


async def replay(
    client, requests: list[Request], label: str = "", timeout_s: float | None = None
) -> list[Record]:
    """Send each request at its arrival time; the records in request order."""
    start = time.monotonic()
    tasks: list[asyncio.Task] = []

    def progress(end: str = "") -> None:
        if label:
            done = sum(t.done() for t in tasks)
            sys.stderr.write(
                f"\r{label}: sent {len(tasks)}/{len(requests)}, done {done}, "
                f"{time.monotonic() - start:.1f} s{end}"
            )
            sys.stderr.flush()

    async def ticker():  # a line redrawn each second on a terminal; else only the last
        while sys.stderr.isatty():
            progress()
            await asyncio.sleep(1.0)

    tick = asyncio.create_task(ticker())
    try:
        for i, req in enumerate(requests):
            delay = start + req.arrival_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_one(client, i, req, start, timeout_s)))
        records = await asyncio.gather(*tasks)
    finally:
        tick.cancel()
        await client.aclose()
    progress("\n")
    return list(records)
