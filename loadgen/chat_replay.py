"""Closed-loop replay of conversations (``loadgen.multiturn``): each conversation starts at
its arrival time; each later turn is sent ``think_s`` after the previous answer ended,
its prompt = the previous prompt + the answer's token ids as the server generated them
+ the turn's own ids. Conversations run concurrently, each waiting only on itself.

Records come one per turn, conversation-major (conversation 0's turns, then 1's, ...),
``index`` their position. A turn's ``lag_ms`` is how late it was sent against its
schedule (the arrival for turn 0, the previous answer's end + think time after).
A failed turn ends its conversation: the turns after it get a record with
``error = "SKIPPED: ..."``, so a run always has one record per turn and a failure
meets no objective. Only the router's client answers with the token ids a next turn
needs; an OpenAI endpoint client (``fill``) is refused.
"""

from __future__ import annotations

import asyncio
import sys
import time

from pdserve.loadgen.metrics import Record
from pdserve.loadgen.multiturn import Conversation
from pdserve.loadgen.replay import from_router


async def _conversation(
    client, conv: Conversation, first: int, start: float, timeout_s: float | None
) -> list[Record]:
    records: list[Record] = []
    prompt: list[int] = []
    answer: list[int] | None = []
    due = start + conv.arrival_s
    for k, turn in enumerate(conv.turns):
        if answer is None:
            rec = Record(first + k, time.monotonic() - start, len(prompt), turn.output_len)
            rec.error = f"SKIPPED: turn {k - 1} of conversation {conv.index} failed"
            records.append(rec)
            continue
        due += turn.think_s
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        prompt = prompt + answer + turn.ids
        now = time.monotonic()
        rec = Record(first + k, now - start, len(prompt), turn.output_len, lag_ms=(now - due) * 1e3)
        answer = await from_router(client, rec, prompt, turn.output_len, timeout_s)
        if answer is not None and not rec.ok:
            answer = None  # ended without its answer (aborted): the history is broken
        due = time.monotonic()
        records.append(rec)
    return records


async def replay_conversations(
    client, conversations: list[Conversation], label: str = "", timeout_s: float | None = None
) -> list[Record]:
    """Run every conversation closed-loop; one record per turn, conversation-major."""
    if hasattr(client, "fill"):
        raise ValueError(
            "workload multiturn: needs the router's client (the next turn carries the "
            "answer's token ids); an --endpoint server does not return them"
        )
    start = time.monotonic()
    firsts, n = [], 0
    for conv in conversations:
        firsts.append(n)
        n += len(conv.turns)
    tasks = [
        asyncio.create_task(_conversation(client, c, f, start, timeout_s))
        for c, f in zip(conversations, firsts, strict=True)
    ]
    try:
        done = await asyncio.gather(*tasks)
    finally:
        await client.aclose()
    if label:
        sys.stderr.write(
            f"{label}: {len(conversations)} conversations, {n} turns, "
            f"{time.monotonic() - start:.1f} s\n"
        )
    return [rec for records in done for rec in records]
