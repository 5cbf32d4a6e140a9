"""What an instance's serving loop records for others to take at their own pace: its
step times (``StepLog``, the samples ``pdserve profile --served`` fits its cost model to,
``planner.served``) and its prefix cache's changes (``CacheLog``, the block hashes the
router routes by)."""

from __future__ import annotations

import threading
import uuid
from collections import deque

from pdserve.engine.block_manager import CacheEvents
from pdserve.engine.scheduler import StepShape
from pdserve.instance.messages import CacheCursor, CacheDelta


class StepLog:
    """The latest ``capacity`` steps as ``[prefill_tokens, sum_sq, decodes, context,
    seconds]``; seconds span one turn of the serving loop up to its updates (calls applied,
    the role's work between steps, the step), i.e. what a request waits per step."""

    def __init__(self, capacity: int = 50_000):
        self._rows: deque[list[float]] = deque(maxlen=capacity)
        self._lock = threading.Lock()  # the step loop records, an actor call takes

    def record(self, shape: StepShape, seconds: float) -> list[float]:
        """Keep one step; its row."""
        row = [shape.prefill_tokens, shape.sum_sq, shape.decodes, shape.context, seconds]
        with self._lock:
            self._rows.append(row)
        return row

    def take(self) -> list[list[float]]:
        """Everything recorded since the last take."""
        with self._lock:
            rows = list(self._rows)
            self._rows.clear()
        return rows


class CacheLog:
    """What an instance publishes of its prefix cache: the block hashes it holds, as events
    any number of consumers (the router) read at their own pace (docs/serving.md,
    "Cache-aware routing").

    The step loop ``record``s the block manager's ``take_events()`` after each round of ops
    and step (one batch, one ``seq``); a consumer's ``poll`` passes the ``CacheCursor`` of
    the last ``CacheDelta`` it applied and gets what changed since (``since``). The log
    keeps no state per consumer, so none is lost between one consumer's polls however
    many others poll, and a consumer resynchronises on its own:

    - a new consumer (``CacheCursor()``), one of an earlier incarnation of the instance (each
      log has a random ``epoch``: a restarted instance starts a new one), or one behind the
      retained events gets a snapshot: every hash cached now;
    - otherwise the events after its cursor, or the snapshot when that is shorter.

    Bound: the log retains at most ``retain`` events (oldest batches dropped first; the
    worker sets it to the instance's KV block count), and the snapshot holds at most one
    hash per KV block, so one delta carries at most ``max(retain, num_blocks)`` hashes.

    Not thread-safe: the worker calls it under its lock (instance/worker.py)."""

    def __init__(self, retain: int):
        if retain < 1:
            raise ValueError(f"CacheLog(retain={retain}): at least 1 event must be retained")
        self.retain = retain
        self.epoch = uuid.uuid4().hex[:12]
        self.seq = 0  # batches recorded so far; the seq of the newest
        self.cached: set[int] = set()  # every hash cached as of ``seq``
        # (seq, events) of the newest batches, oldest first; ``_retained`` events in all
        self._batches: deque[tuple[int, CacheEvents]] = deque()
        self._retained = 0

    def record(self, events: CacheEvents) -> None:
        """One batch of the block manager's events (nothing happens for an empty one)."""
        if not events.stored and not events.removed:
            return
        self.seq += 1
        CacheDelta(self.epoch, self.seq, False, events.stored, events.removed).apply_to(self.cached)
        self._batches.append((self.seq, events))
        self._retained += len(events.stored) + len(events.removed)
        while self._retained > self.retain:
            _, old = self._batches.popleft()
            self._retained -= len(old.stored) + len(old.removed)

    def has_news(self, cursor: CacheCursor | None) -> bool:
        """A poll with ``cursor`` would carry changes (None: the consumer asks for none)."""
        return cursor is not None and (cursor.epoch != self.epoch or cursor.seq != self.seq)

    def since(self, cursor: CacheCursor | None) -> CacheDelta | None:
        """What changed after ``cursor``: the events, or a snapshot (see the module)."""
        if cursor is None:
            return None
        if cursor.epoch == self.epoch and cursor.seq == self.seq:
            return CacheDelta(self.epoch, self.seq)
        first = self._batches[0][0] if self._batches else self.seq + 1
        if cursor.epoch == self.epoch and first <= cursor.seq + 1 <= self.seq:
            delta = CacheDelta(self.epoch, self.seq)
            for seq, events in self._batches:
                if seq > cursor.seq:
                    delta.stored += events.stored
                    delta.removed += events.removed
            if len(delta.stored) + len(delta.removed) <= len(self.cached):
                return delta
        return CacheDelta(self.epoch, self.seq, snapshot=True, stored=list(self.cached))
