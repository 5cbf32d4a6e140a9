"""The router's side of one engine instance: its handle, its load, its update stream.

Data plane: one long-poll loop per instance fetches every update the instance produced
since the previous poll (one Ray call per engine step at most, whatever the number of
requests) and hands them to the placement (router/placement.py), which routes each to
its ``RequestStream``.

Lifecycle (docs/serving.md, "Supervision and migration")::

    starting --ready--> serving --poll fails / ejected--> failed --readmitted--> serving

Each incarnation of the instance has a ``generation`` (0 at launch, +1 per restart by
the cluster's supervisor): a failure is reported with the generation it concerns, so a
late report about a dead incarnation never ejects its successor.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from router.cache_index import CacheIndex
from router.incidents import first_line
from router.policies import InstanceLoad
from router.stream import RequestStream

log = logging.getLogger(__name__)

CONSUMER = "router"  # our outbox name on the workers
POLL_TIMEOUT_S = 0.5


class Instance:
    def __init__(self, name: str, role: str, handle, index: int):
        self.name, self.role, self.handle = name, role, handle
        self.load = InstanceLoad(name=name, index=index)
        self.capacity = 0  # max requests held and unfinished (its max_batch_size)
        self.info: dict = {}
        self.last_stats: dict = {}  # its stats() as the latest poll brought them
        self.ready = False
        self.dead: str | None = None  # why, while the instance is failed
        self.generation = 0  # restarts so far (each one a new incarnation)
        self.restarting = False  # failed, and its supervisor is starting it again
        # it refused a reservation: no room until its next report says otherwise
        self.refused = False
        self.requests_total = 0
        self.streams: dict[str, RequestStream] = {}  # by the id the instance knows
        self.cache = CacheIndex()  # the block hashes its prefix cache holds (as last polled)
        self._task: asyncio.Task | None = None

    @property
    def alive(self) -> bool:
        return self.ready and self.dead is None

    @property
    def state(self) -> str:
        if self.dead is not None:
            return "restarting" if self.restarting else "failed"
        return "serving" if self.ready else "starting"

    def has_room(self) -> bool:
        return self.alive and not self.refused and self.load.outstanding < self.capacity

    async def wait_ready(self) -> dict:
        self.info = await self.handle.ready.remote()
        self.capacity = self.info["max_batch_size"]
        self.load.total_blocks = self.load.free_blocks = self.info["num_blocks"]
        self.load.block_size = self.info["block_size"]
        self.ready = True
        return self.info

    def hold(self, stream: RequestStream) -> None:
        """The instance now holds (part of) this request."""
        self.streams[stream.attempt_id] = stream
        self.load.outstanding += 1
        self.requests_total += 1

    def release(self, stream: RequestStream, abort: bool = False) -> bool:
        """Forget the request (and with ``abort``, have the instance drop it and free its
        blocks); False when the instance did not hold it."""
        if self.streams.pop(stream.attempt_id, None) is None:
            return False
        self.load.outstanding -= 1
        if abort and self.dead is None:
            self.handle.abort.remote([stream.attempt_id])
        return True

    def start_polling(
        self,
        on_updates: Callable[[Instance, list], None],
        on_dead: Callable[[Instance], None],
    ) -> None:
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._poll(on_updates, on_dead))

    async def stop_polling(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def fail(self, why: str, restarting: bool) -> None:
        """Out of routing from now on (its poll stops); the placement then deals with the
        requests it held."""
        self.dead, self.restarting = why, restarting
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()
        log.error("%s (generation %d)", why, self.generation)

    def readmit(self, handle, generation: int, info: dict) -> None:
        """A new incarnation answered ``ready()``: back in routing, with nothing held."""
        assert not self.streams, f"{self.name}: readmitted while holding {list(self.streams)}"
        self.handle, self.generation, self.info = handle, generation, info
        self.dead, self.restarting, self.refused = None, False, False
        self.load.outstanding = self.load.running = self.load.queued = 0
        self.load.prefill_tokens = 0
        self.load.free_blocks = info["num_blocks"]
        self.cache = CacheIndex()

    async def stats(self) -> dict:
        if self.dead is not None:
            return {"name": self.name, "dead": self.dead}
        return await self.handle.stats.remote()

    async def _poll(self, on_updates, on_dead) -> None:
        while True:
            try:
                polled = await self.handle.poll.remote(CONSUMER, POLL_TIMEOUT_S, self.cache.cursor)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the actor died
                on_dead(self, f"instance {self.name} failed: {first_line(e)}")
                return
            stats = polled.stats
            self.last_stats = stats
            self.load.running, self.load.queued = stats["running"], stats["queued"]
            self.load.free_blocks = stats["free_blocks"]
            self.refused = False
            self.cache.apply(polled.cache)  # before the updates: a finished prompt's blocks
            on_updates(self, polled.updates)
