"""Who gets into the router: the admission queue and the bound on concurrent calls.

``AdmissionQueue``: requests waiting for an instance with room. Bounded: past
``max_size`` waiting requests, ``offer`` refuses and the core refuses the request as
busy (router/request.py). FIFO, so a request is never overtaken by a later one.

``FirstTokens``: how long a request arriving now would wait for its first token, by
Little's law over the whole path (the router's queue and the instances' own): the
requests in flight still without a first token over the rate at which requests got
their first token in the last ``WINDOW_S`` (the mean time one of them waits: nothing
while none waits, however low the rate). The core refuses at once a
request whose expected wait is past ``router.max_expected_ttft_s`` rather than serve
it too late.

``CallLimit``: generate calls in progress at the front ends, from the moment a call
arrives until its handler returns (its last bytes written), over both front ends.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

from pdserve.router.request import Refusal, Refused

T = TypeVar("T")
WINDOW_S = 10.0  # the first tokens their rate is measured over


class AdmissionQueue(Generic[T]):
    def __init__(self, max_size: int):
        if max_size < 0:
            raise ValueError(f"router.max_queue={max_size!r}: must be >= 0")
        self.max_size = max_size
        self._items: deque[T] = deque()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, item: T) -> bool:
        return item in self._items

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


class FirstTokens:
    """The rate of first tokens (requests starting to stream) over the last ``WINDOW_S``."""

    def __init__(self):
        self._times: deque[float] = deque()

    def note(self) -> None:
        """A request got its first token now."""
        self._times.append(time.monotonic())
        self._forget_old()

    def expected_wait_s(self, waiting: int) -> float | None:
        """Seconds a request arriving now is expected to wait for its first token,
        ``waiting`` others in flight without theirs: ``waiting`` over the rate; None
        (unknown) while fewer than two first tokens came in the window."""
        self._forget_old()
        if len(self._times) < 2:
            return None
        span = max(time.monotonic() - self._times[0], 1e-3)
        return waiting * span / len(self._times)

    def _forget_old(self) -> None:
        now = time.monotonic()
        while self._times and now - self._times[0] > WINDOW_S:
            self._times.popleft()


class CallLimit:
    """At most ``max_calls`` generate calls at once (``router.max_concurrent_requests``),
    at most ``per_owner`` of them by one API key
    (``router.max_concurrent_requests_per_key``; None: no bound per key), and at most
    ``per_address`` from one client address where the call gives one (the front ends
    give it when no API keys are set: ``router.max_concurrent_requests_per_address``;
    None: no bound per address).

    Invariant: ``active`` is the number of ``call()`` blocks entered and not yet left,
    and never exceeds ``max_calls``; ``by_owner`` and ``by_address`` hold each owner's
    and each address's (only those with one at least), each at most its bound; a call
    past a bound is refused at once, before it reads its body or reaches the core."""

    def __init__(
        self,
        max_calls: int,
        per_owner: int | None = None,
        describe: Callable[[str], str] | None = None,
        per_address: int | None = None,
    ):
        """``describe``: a bound's config key (``max_concurrent_requests``,
        ``max_concurrent_requests_per_key``, ``max_concurrent_requests_per_address``)
        as a refusal names it (default ``router.<key>=<bound>``; a router replica names
        its share, router/replicas.py)."""
        bounds = {
            "max_concurrent_requests": max_calls,
            "max_concurrent_requests_per_key": per_owner,
            "max_concurrent_requests_per_address": per_address,
        }
        for key, bound in bounds.items():
            if bound is not None and bound < 1:
                null = "" if key == "max_concurrent_requests" else " or null"
                raise ValueError(f"router.{key}={bound!r}: must be >= 1{null}")
        self.max_calls, self.per_owner, self.per_address = max_calls, per_owner, per_address
        self.describe = describe or (lambda key: f"router.{key}={bounds[key]}")
        self.active = 0
        self.by_owner: dict[str, int] = {}
        self.by_address: dict[str, int] = {}

    @contextmanager
    def call(self, owner: str = "", address: str | None = None) -> Iterator[None]:
        """Hold a place for the block; raises ``Refused`` (BUSY) when none is left.
        ``address``: the client's address, counted against ``per_address`` (None: not
        counted)."""
        if self.active >= self.max_calls:
            raise Refused(
                Refusal.BUSY,
                f"{self.active} requests in progress, the most the router serves at once "
                f"({self.describe('max_concurrent_requests')}); retry later",
                reason="concurrency",
            )
        mine = self.by_owner.get(owner, 0)
        if self.per_owner is not None and mine >= self.per_owner:
            raise Refused(
                Refusal.BUSY,
                f"{mine} requests in progress with this API key, the most one key may have "
                f"({self.describe('max_concurrent_requests_per_key')}); retry later",
                reason="concurrency_per_key",
            )
        here = 0 if address is None else self.by_address.get(address, 0)
        if address is not None and self.per_address is not None and here >= self.per_address:
            raise Refused(
                Refusal.BUSY,
                f"{here} requests in progress from address {address}, the most one address "
                f"may have ({self.describe('max_concurrent_requests_per_address')}); "
                "retry later",
                reason="concurrency_per_address",
            )
        self.active += 1
        self.by_owner[owner] = mine + 1
        if address is not None:
            self.by_address[address] = here + 1
        try:
            yield
        finally:
            self.active -= 1
            _release(self.by_owner, owner)
            if address is not None:
                _release(self.by_address, address)


def _release(counts: dict[str, int], key: str) -> None:
    """One call of ``key`` ended: its count less one, the key gone at zero."""
    left = counts[key] - 1
    if left:
        counts[key] = left
    else:
        del counts[key]
