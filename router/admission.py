"""The router's admission queue: requests waiting for an instance with room.

Bounded: past ``max_size`` waiting requests, ``offer`` refuses and the core refuses
the request as busy (router/request.py). FIFO, so a request is never overtaken by a
later one.
"""

from __future__ import annotations

from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


class AdmissionQueue(Generic[T]):
    def __init__(self, max_size: int):
        if max_size < 0:
            raise ValueError(f"router.max_queue={max_size!r}: must be >= 0")
        self.max_size = max_size
        self._items: deque[T] = deque()

    def __len__(self) -> int:
        return len(self._items)

    def offer(self, item: T) -> bool:
        """Append ``item``; False (and nothing queued) when the queue is full."""
        if len(self._items) >= self.max_size:
            return False
        self._items.append(item)
        return True

    def push_front(self, item: T) -> None:
        """Put back an item taken from the head (it was admitted: the bound does not apply)."""
        self._items.appendleft(item)

    def peek(self) -> T | None:
        return self._items[0] if self._items else None

    def pop(self) -> T:
        return self._items.popleft()

    def remove(self, item: T) -> bool:
        """Take a waiting item out (its client went away); False when it is not waiting."""
        try:
            self._items.remove(item)
        except ValueError:
            return False
        return True

    def drain(self) -> list[T]:
        items = list(self._items)
        self._items.clear()
        return items
