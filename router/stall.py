"""Every placed stream is bounded by progress (docs/serving.md, "Stalled streams").

A stream makes progress when the placement moves it on (placed, its KV blocks
reserved, its KV landed, migrated) and when tokens arrive; each time it records what it
waits for next (``RequestStream.waits_for``). ``StallWatch`` ends a stream that has
waited ``router.stall_timeout_s`` for the same thing with an error naming it, whatever
its deadline: an instance that hangs without its process dying (SIGSTOP before the
supervisor's ``unresponsive_s``, a reservation never answered), or a migration that
finds no instance to continue on.

Invariant: a stream stalls at most ``stall_timeout_s + interval_s`` after its last
progress. A stream waiting for its first placement (``waiting_for`` empty) is not
watched: ``router.queue_timeout_s`` bounds that wait.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from pdserve.router.stream import RequestStream


class StallWatch:
    def __init__(self, timeout_s: float, on_stall: Callable[[RequestStream, str], None]):
        """``on_stall(stream, message)``: end ``stream`` with ``message`` (the core's)."""
        self.timeout_s = timeout_s
        self.interval_s = min(1.0, timeout_s / 4)
        self.on_stall = on_stall
        self._task: asyncio.Task | None = None

    def start(self, streams: dict[str, RequestStream]) -> None:
        """Check ``streams`` (the core's in flight, read live) every ``interval_s``."""
        self._task = asyncio.get_running_loop().create_task(self._watch(streams))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def check(self, streams: dict[str, RequestStream]) -> None:
        """End every stream that made no progress for ``timeout_s``."""
        now = time.monotonic()
        for stream in list(streams.values()):
            idle = now - stream.progress_at
            if stream.waiting_for and not stream.finished and idle > self.timeout_s:
                self.on_stall(
                    stream,
                    f"no progress for {idle:.3g} s (router.stall_timeout_s="
                    f"{self.timeout_s:g}): waited for {stream.waiting_for}",
                )

    async def _watch(self, streams: dict[str, RequestStream]) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self.check(streams)
