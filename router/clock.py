"""A request's clock at the router: when it arrived, was placed, and got each token.

TTFT, TPOT and e2e come from the router's clock (``time.monotonic``): arrival is
stamped when the request reaches a front end, first/last token when their batches
reach the router. Wall-clock stamps (``time.time``) place the router's events among the
instances' phase times (``Phases``, router/stream.py), relative to ``arrival_wall``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Clock:
    """Set at arrival (the core opens the stream, or a restarted router rebuilds it with
    the arrival its attempts recorded); from then on written only by its methods, which
    the stream calls: ``placed`` (``RequestStream.sent_to``), ``tokens``
    (``RequestStream.deliver``) and ``adopted`` (a rebuilt stream, router/rebuild.py)."""

    arrival: float = field(default_factory=time.monotonic)
    arrival_wall: float = field(default_factory=time.time)
    dispatched_at: float | None = None  # last sent to an instance
    placed_wall: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    token_walls: list[float] = field(default_factory=list)  # each token's arrival

    def placed(self) -> None:
        """The request was sent to an instance now."""
        self.dispatched_at = time.monotonic()
        self.placed_wall = time.time()

    def adopted(self) -> None:
        """A restarted router found the request running: it counts as sent at arrival."""
        self.dispatched_at = self.arrival

    def tokens(self, count: int, now: float) -> bool:
        """``count`` (> 0) tokens reached the router at ``now`` (``time.monotonic``);
        True for the request's first."""
        first = self.first_token_at is None
        if first:
            self.first_token_at = now
        self.last_token_at = now
        self.token_walls += [time.time()] * count
        return first

    def since_arrival_ms(self, wall: float | None) -> float:
        """A wall-clock stamp in ms since the arrival's (0 for none)."""
        return ms(wall - self.arrival_wall) if wall else 0.0


def ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)
