"""The request side of one ``Push`` call: a bounded queue that gRPC's sending thread drains."""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

from kv_transfer.errors import KVPeerError


class PushStream:
    """The request side of one Push call: a bounded queue of segments that gRPC's sending
    thread drains, packing the segments queued by then (up to ``chunk`` bytes) into each
    message as it goes."""

    def __init__(self, limit: int, chunk: int, encode: Callable[[list], bytes]):
        self.limit, self.chunk, self.encode = limit, chunk, encode
        self.queue: collections.deque[tuple[object, int]] = collections.deque()
        self.queued = 0
        self.closed = False
        self.failed: BaseException | None = None
        self.cond = threading.Condition()
        self.future = None

    def put(self, item: object, size: int) -> None:
        with self.cond:
            while self.queued and self.queued + size > self.limit and not self.failed:
                self.cond.wait()
            if self.failed is not None:
                raise KVPeerError(f"KV push stream failed: {self.failed}")
            self.queue.append((item, size))
            self.queued += size
            self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self.cond:
            self.failed = error
            self.closed = True
            self.queue.clear()
            self.queued = 0
            self.cond.notify_all()

    def __iter__(self):
        return self

    def __next__(self) -> bytes:
        with self.cond:
            while not self.queue and not self.closed:
                self.cond.wait()
            if not self.queue:
                raise StopIteration
            items, size = [], 0
            while self.queue and (not items or size + self.queue[0][1] <= self.chunk):
                item, n = self.queue.popleft()
                items.append(item)
                size += n
        msg = self.encode(items)
        with self.cond:
            self.queued -= size
            self.cond.notify_all()
        return msg
