"""The router's side of one engine instance: its handle, its load, its update stream.

Data plane: the instance pushes, down its update feed (instance/feed.py; one TCP
connection, opened with a ticket asked for through Ray), every update it produced since
its previous frame, at most one frame per engine step whatever the number of requests;
each frame's updates go to the placement (router/placement.py), which routes each to
its ``RequestStream``. ``add``, ``abort`` and the disaggregated handoff's ``reserve``
(its answer comes down the feed) and ``prefill`` go up the same connection, in order.
The feed's end is the instance's failure: a ``reserve`` still unanswered then fails.

Lifecycle (docs/serving.md, "Supervision and migration")::

    starting --ready--> serving --feed ends / ejected--> failed --readmitted--> serving

Load accounting: the router's own counts of an instance's load (``load.outstanding``,
``load.prefill_tokens``, ``placed_since_frame``, ``requests_total``) are written only by
``hold``, ``prompt_done``, ``release`` and ``readmit``; the counts the instance reports
(running, queued, free blocks) only by its feed's frames. Invariant: ``load.outstanding``
is the number of attempts held and ``load.prefill_tokens`` the sum of the prompt tokens
charged to those of them whose prompt is not done.

Each incarnation of the instance has a ``generation`` (0 at launch, +1 per restart by
the cluster's supervisor): a failure is reported with the generation it concerns, so a
late report about a dead incarnation never ejects its successor.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from pdserve.instance.feed import cut, decode, encode_command
from pdserve.instance.messages import Attempt, Polled
from pdserve.router.cache_index import CacheIndex
from pdserve.router.incidents import first_line
from pdserve.router.policies import InstanceLoad
from pdserve.router.replicas import replica_name
from pdserve.router.stream import RequestStream

log = logging.getLogger(__name__)


class Instance:
    def __init__(
        self,
        name: str,
        role: str,
        handle,
        index: int,
        consumer: str = replica_name(0),
        shared: bool = False,
    ):
        """``consumer``: this router's outbox name on the instance (its replica's name,
        router/replicas.py); ``shared``: other router replicas place on the instance too,
        so its room counts what it reports holding."""
        self.name, self.role, self.handle = name, role, handle
        self.consumer, self.shared = consumer, shared
        self.load = InstanceLoad(name=name, index=index)
        self.capacity = 0  # max requests held and unfinished (its max_batch_size)
        self.info: dict = {}
        self.last_stats: dict = {}  # its stats() as the latest frame brought them
        self.ready = False
        self.dead: str | None = None  # why, while the instance is failed
        self.generation = 0  # restarts so far (each one a new incarnation)
        self.restarting = False  # failed, and its supervisor is starting it again
        # it refused a reservation: no room until its next report says otherwise
        self.refused = False
        self.requests_total = 0
        self.placed_since_frame = 0  # holds since the latest frame's stats (shared room)
        self.streams: dict[str, RequestStream] = {}  # by the id the instance knows
        self._prompts: dict[str, int] = {}  # attempt id -> its prompt tokens not computed yet
        self.cache = CacheIndex()  # the block hashes its prefix cache holds (as last fed)
        self._task: asyncio.Task | None = None
        self._feed: FeedReader | None = None  # while its update feed is connected
        self._unsent: list[bytes] = []  # commands given before the feed connected
        self._reserving: dict[str, asyncio.Future] = {}  # attempt id -> its answer to come
        self._on_live: Callable[[Instance, list], None] = lambda inst, live: None

    @property
    def alive(self) -> bool:
        return self.ready and self.dead is None

    @property
    def state(self) -> str:
        if self.dead is not None:
            return "restarting" if self.restarting else "failed"
        return "serving" if self.ready else "starting"

    def has_room(self) -> bool:
        return self.alive and not self.refused and self.held() < self.capacity

    def held(self) -> int:
        """Requests the instance holds as far as this router knows: its own placements
        not finished; with other router replicas, at least what the instance last
        reported (running and queued, everyone's) plus this router's placements since."""
        if not self.shared:
            return self.load.outstanding
        reported = self.load.running + self.load.queued + self.placed_since_frame
        return max(self.load.outstanding, reported)

    async def wait_ready(self) -> dict:
        self._take(await self.handle.ready.remote())
        return self.info

    def _take(self, info: dict) -> None:
        """An incarnation's ``ready()`` facts: what routing reads of it."""
        self.info, self.capacity = info, info["max_batch_size"]
        self.load.total_blocks = self.load.free_blocks = info["num_blocks"]
        self.load.block_size = info["block_size"]
        self.ready = True

    def hold(self, stream: RequestStream, prompt_tokens: int = 0) -> None:
        """The instance now holds (part of) this request's current attempt, and computes
        ``prompt_tokens`` of its prompt (counted in ``load.prefill_tokens`` until
        ``prompt_done`` or ``release``)."""
        attempt_id = stream.attempt.id
        self.streams[attempt_id] = stream
        self.load.outstanding += 1
        self.placed_since_frame += 1
        self.requests_total += 1
        if prompt_tokens:
            self._prompts[attempt_id] = prompt_tokens
            self.load.prefill_tokens += prompt_tokens

    def prompt_done(self, attempt_id: str) -> None:
        """The attempt's prompt no longer waits here (computed, or the attempt gone);
        a no-op the second time."""
        self.load.prefill_tokens -= self._prompts.pop(attempt_id, 0)

    def release(self, attempt_id: str, abort: bool = False) -> bool:
        """Forget the attempt (and with ``abort``, have the instance drop it and free its
        blocks); False when the instance did not hold it."""
        if self.streams.pop(attempt_id, None) is None:
            return False
        self.load.outstanding -= 1
        self.prompt_done(attempt_id)
        if abort:
            self.abort([attempt_id])
        return True

    def add(self, attempt: Attempt) -> None:
        """Have the instance run ``attempt`` (``EngineWorker.add``, sent up its feed)."""
        self._send(encode_command("add", attempt))

    def prefill(self, attempt: Attempt) -> None:
        """Have the instance prefill ``attempt`` and hand its KV to
        ``attempt.destination`` (the worker's ``prefill``, served by its ``Sending`` part;
        sent up its feed)."""
        self._send(encode_command("prefill", attempt))

    def reserve(self, attempt: Attempt) -> asyncio.Future:
        """Have the decode instance hold blocks for ``attempt`` (the worker's ``reserve``,
        served by its ``Receiving`` part; sent up its feed): a future of the
        ``KVDestination`` bytes, None when it has no room; it raises ``RuntimeError`` when
        the reservation failed or the instance did."""
        answer = asyncio.get_running_loop().create_future()
        if self.dead is not None:
            answer.set_exception(RuntimeError(self.dead))
            return answer
        self._reserving[attempt.id] = answer
        self._send(encode_command("reserve", attempt))
        return answer

    def abort(self, attempt_ids: list[str]) -> None:
        """Have the instance drop these attempts and free their blocks (none when dead)."""
        if self.dead is None:
            self._send(encode_command("abort", attempt_ids))

    def _send(self, frame: bytes) -> None:
        # commands go in the order given; those before the feed connects wait for it
        # (a failed instance drops them: its requests migrate, router/placement.py)
        if self._feed is not None:
            self._feed.send(frame)
        elif self.dead is None:
            self._unsent.append(frame)

    def start_feed(
        self,
        on_updates: Callable[[Instance, list], None],
        on_dead: Callable[[Instance, str], None],
        on_live: Callable[[Instance, list], None],
    ) -> None:
        """Follow the feed: ``on_live`` with the first frame's ``LiveAttempt``s (what the
        instance still holds for this consumer), ``on_updates`` with each frame's updates,
        ``on_dead`` when it ends."""
        self._on_live = on_live
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._follow(on_updates, on_dead))

    async def stop_feed(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def fail(self, why: str, restarting: bool) -> None:
        """Out of routing from now on (its feed is closed); the placement then deals with the
        requests it held."""
        self.dead, self.restarting = why, restarting
        self._feed, self._unsent = None, []
        reserving, self._reserving = self._reserving, {}
        for answer in reserving.values():
            if not answer.done():
                answer.set_exception(RuntimeError(why))
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()
        log.error("%s (generation %d)", why, self.generation)

    def readmit(self, handle, generation: int, info: dict) -> None:
        """A new incarnation answered ``ready()``: back in routing, with nothing held (the
        placement ended the old incarnation's attempts first, ``RouterCore.readmit``)."""
        self.handle, self.generation = handle, generation
        self.dead, self.restarting, self.refused = None, False, False
        self.load.outstanding = self.load.running = self.load.queued = 0
        self.placed_since_frame = 0
        self._prompts.clear()
        self.load.prefill_tokens = 0
        self._take(info)  # ready at last, for one that died while this router waited on it
        self.cache = CacheIndex()

    async def stats(self) -> dict:
        if self.dead is not None:
            return {"name": self.name, "dead": self.dead}
        return await self.handle.stats.remote()

    async def _follow(self, on_updates, on_dead) -> None:
        """Follow the instance's update feed until it ends (then ``on_dead``)."""
        transport = reader = None
        try:
            ticket = await self.handle.open_feed.remote(self.consumer, self.cache.cursor)
            transport, reader = await asyncio.get_running_loop().create_connection(
                lambda: FeedReader(ticket.token, lambda polled: self._on_frame(polled, on_updates)),
                *ticket.endpoint(),
            )
            self._feed, unsent, self._unsent = reader, self._unsent, []
            for frame in unsent:
                reader.send(frame)
            why = await reader.lost
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the actor died, or its listener is gone
            why = first_line(e)
        finally:
            if self._feed is reader:
                self._feed = None
            if transport is not None:
                transport.close()
        on_dead(self, f"instance {self.name} failed: {why}")

    def _on_frame(self, polled: Polled, on_updates) -> None:
        stats = polled.stats
        self.last_stats = stats
        self.load.running, self.load.queued = stats["running"], stats["queued"]
        self.load.free_blocks = stats["free_blocks"]
        self.placed_since_frame = 0
        self.refused = False
        for r in polled.reserved:
            answer = self._reserving.pop(r.attempt_id, None)
            if answer is None or answer.done():
                continue
            if r.error is None:
                answer.set_result(r.destination)
            else:
                answer.set_exception(RuntimeError(r.error))
        self.cache.apply(polled.cache)  # before the updates: a finished prompt's blocks
        if polled.live is not None:  # the first frame: its updates follow what these hold
            self._on_live(self, polled.live)
        on_updates(self, polled.updates)


class FeedReader(asyncio.Protocol):
    """The router's end of an instance's update feed (instance/feed.py): an asyncio
    protocol on the router's event loop that sends the ticket's token, then cuts the byte
    stream into frames and hands each decoded ``Polled`` to ``on_polled``, in order, on
    the loop; ``send`` writes a command (``add``, ``abort``) the other way.

    ``lost`` resolves (with why) when the connection ends, which is how the router learns
    an instance is gone; a frame whose length prefix exceeds ``instance.feed.MAX_FRAME``
    ends it too (a broken stream)."""

    def __init__(self, token: str, on_polled: Callable[[Polled], None]):
        self._token = token.encode("ascii")
        self._on_polled = on_polled
        self._buffer = bytearray()
        self._transport: asyncio.Transport | None = None
        self.lost: asyncio.Future = asyncio.get_running_loop().create_future()

    def connection_made(self, transport) -> None:
        self._transport = transport
        transport.write(self._token)

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        try:
            bodies = cut(self._buffer)
        except ValueError as e:  # a broken stream
            self._end(f"its feed broke: {e}")
            return
        for body in bodies:
            self._on_polled(decode(body))

    def send(self, frame: bytes) -> None:
        """A command frame (``instance.feed.encode_command``) to the instance."""
        # connection_made ran: create_connection hands out the protocol only after it
        assert self._transport is not None
        self._transport.write(frame)

    def connection_lost(self, exc: Exception | None) -> None:
        self._end(f"its feed broke: {first_line(exc)}" if exc else "its feed ended")

    def _end(self, why: str) -> None:
        if not self.lost.done():
            self.lost.set_result(why)
        if self._transport is not None:
            self._transport.close()
