"""The router's side of one engine instance: its handle, its load, its token stream.

Data plane: one long-poll loop per instance fetches every output the instance
produced since the previous poll (one Ray call per engine step at most, whatever
the number of requests) and hands each request's part to its ``RequestStream``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from router.policies import InstanceLoad
from router.stream import Delta, RequestStream

log = logging.getLogger(__name__)

CONSUMER = "router"  # our outbox name on the workers
POLL_TIMEOUT_S = 0.5


class Instance:
    def __init__(self, name: str, role: str, handle, index: int):
        self.name, self.role, self.handle = name, role, handle
        self.load = InstanceLoad(name=name, index=index)
        self.capacity = 0  # max requests sent and unfinished (its max_batch_size)
        self.info: dict = {}
        self.ready = False
        self.dead: str | None = None  # why, once the instance is gone
        self.requests_total = 0
        self.streams: dict[str, RequestStream] = {}
        self._task: asyncio.Task | None = None

    def has_room(self) -> bool:
        return self.ready and self.dead is None and self.load.outstanding < self.capacity

    async def wait_ready(self) -> dict:
        self.info = await self.handle.ready.remote()
        self.capacity = self.info["max_batch_size"]
        self.load.total_blocks = self.load.free_blocks = self.info["num_blocks"]
        self.ready = True
        return self.info

    def send(self, stream: RequestStream) -> None:
        """Hand a request to the instance (returns at once; outputs come through polling)."""
        p = stream.params
        params = dict(
            max_tokens=p.max_tokens,
            temperature=p.temperature,
            top_k=p.top_k,
            top_p=p.top_p,
            seed=p.seed,
            stop=p.stop,
            stop_token_ids=p.stop_token_ids,
            ignore_eos=p.ignore_eos,
        )
        self.streams[stream.request_id] = stream
        self.load.outstanding += 1
        self.requests_total += 1
        stream.sent_to(self.name)
        self.handle.add.remote(stream.request_id, stream.prompt_ids, params, CONSUMER)

    def abort(self, stream: RequestStream) -> bool:
        """Forget a request and have the instance free its blocks."""
        if self.streams.pop(stream.request_id, None) is None:
            return False
        self.load.outstanding -= 1
        if self.dead is None:
            self.handle.abort.remote([stream.request_id])
        return True

    def start_polling(self, on_finished: Callable[[list[RequestStream]], None]) -> None:
        self._task = asyncio.get_running_loop().create_task(self._poll(on_finished))

    async def stop_polling(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def stats(self) -> dict:
        if self.dead is not None:
            return {"name": self.name, "dead": self.dead}
        return await self.handle.stats.remote()

    async def _poll(self, on_finished: Callable[[list[RequestStream]], None]) -> None:
        while True:
            try:
                items, stats = await self.handle.poll.remote(CONSUMER, POLL_TIMEOUT_S)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the actor died: fail what it held
                on_finished(self._fail_all(f"instance {self.name} failed: {e}"))
                return
            self.load.running, self.load.queued = stats["running"], stats["queued"]
            self.load.free_blocks = stats["free_blocks"]
            finished = []
            for request_id, token_ids, text, reason, error in items:
                stream = self.streams.get(request_id)
                if stream is None:
                    continue  # aborted meanwhile
                stream.deliver(Delta(token_ids, text, reason, error))
                if reason is not None:
                    del self.streams[request_id]
                    self.load.outstanding -= 1
                    finished.append(stream)
            if finished:
                on_finished(finished)

    def _fail_all(self, why: str) -> list[RequestStream]:
        log.error(why)
        self.dead = why
        failed = list(self.streams.values())
        for stream in failed:
            stream.deliver(Delta([], "", "error", why))
        self.streams.clear()
        self.load.outstanding = 0
        return failed
