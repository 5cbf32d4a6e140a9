"""One request's life at the router: its output queue, its clock, its final usage and
timings (plain dataclasses; each front end renders them in its own wire format).

TTFT, TPOT and e2e come from the router's clock (``time.monotonic``): arrival is
stamped when the request reaches a front end, first/last token when their batches
reach the router. Phase times (``Phases``) mix the router's and the instances' wall
clocks (``time.time``) and are reported relative to the arrival's wall-clock stamp.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams

_PHASES = ("prefill_start", "prefill_end", "transfer_start", "transfer_end", "decode_start")


@dataclass
class Delta:
    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    error: str | None = None  # set when the instance failed the request


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class Phases:
    """When each phase of a request began or ended, in ms since its arrival (0: not
    applicable, e.g. no transfer when co-located); ``tokens``: each token's arrival."""

    queued: float = 0.0  # left the admission queue (placed on instances)
    prefill_start: float = 0.0
    prefill_end: float = 0.0
    transfer_start: float = 0.0
    transfer_end: float = 0.0
    decode_start: float = 0.0
    tokens: list[float] = field(default_factory=list)
    finish: float = 0.0


@dataclass
class Timings:
    """A finished request's times in ms (the router's clock) and where it ran."""

    queue_ms: float  # arrival -> sent to an instance
    ttft_ms: float  # arrival -> first token (0 without tokens)
    tpot_ms: float  # mean gap between later tokens (0 with one token)
    e2e_ms: float  # arrival -> last token
    instances: list[str]
    kv_bytes: int = 0  # disaggregated: KV moved from the prefill to the decode instance
    transfer_ms: float = 0.0
    attempts: int = 1
    phases: Phases = field(default_factory=Phases)


@dataclass(eq=False)
class RequestStream:
    """One admitted request until its final delta.

    The placement delivers its instances' output (``deliver``, on the router's event
    loop); a front end reads it (``read``) until a delta has a finish reason or an
    error, then reports ``usage()`` and ``timings()``.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.monotonic)
    arrival_wall: float = field(default_factory=time.time)
    instances: list[str] = field(default_factory=list)
    dispatched_at: float | None = None
    placed_wall: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    token_walls: list[float] = field(default_factory=list)
    num_tokens: int = 0
    finished: bool = False
    queue: asyncio.Queue[Delta] = field(default_factory=asyncio.Queue)
    # placement: the id the instances know this attempt by, and the attempt's history
    attempt_id: str = ""
    attempt: int = 0
    pair: tuple[str, ...] = ()
    avoid: set[str] = field(default_factory=set)  # instances of a failed attempt
    retried_because: str = ""
    info: dict = field(default_factory=dict)  # what the instances reported (phases, KV)

    def sent_to(self, instance: str) -> None:
        self.instances.append(instance)
        self.dispatched_at = time.monotonic()
        self.placed_wall = time.time()

    def deliver(self, delta: Delta) -> None:
        """A batch of this request's tokens arrived from its instance."""
        if self.finished:
            return
        now = time.monotonic()
        if delta.token_ids:
            self.first_token_at = self.first_token_at or now
            self.last_token_at = now
            self.num_tokens += len(delta.token_ids)
            self.token_walls += [time.time()] * len(delta.token_ids)
        if delta.finish_reason is not None or delta.error is not None:
            self.finished = True
        self.queue.put_nowait(delta)

    async def read(self) -> Delta:
        """The next delta for the client: every delta already waiting, merged."""
        return _merge_waiting(await self.queue.get(), self.queue)

    def usage(self) -> Usage:
        return Usage(len(self.prompt_ids), self.num_tokens)

    def timings(self) -> Timings:
        end = self.last_token_at or time.monotonic()
        first = self.first_token_at
        gaps = self.num_tokens - 1
        since = self._since_arrival
        phases = self.info.get("phases", {})
        return Timings(
            queue_ms=_ms((self.dispatched_at or end) - self.arrival),
            ttft_ms=_ms(first - self.arrival) if first is not None else 0.0,
            tpot_ms=_ms((end - first) / gaps) if first is not None and gaps > 0 else 0.0,
            e2e_ms=_ms(end - self.arrival),
            instances=list(self.instances),
            kv_bytes=int(self.info.get("kv_bytes", 0)),
            transfer_ms=_ms(self.info.get("transfer_s", 0.0)),
            attempts=self.attempt + 1,
            phases=Phases(
                queued=since(self.placed_wall),
                **{name: since(phases.get(name)) for name in _PHASES},
                tokens=[since(t) for t in self.token_walls],
                finish=since(self.token_walls[-1] if self.token_walls else None),
            ),
        )

    def _since_arrival(self, wall: float | None) -> float:
        return _ms(wall - self.arrival_wall) if wall else 0.0


def _merge_waiting(delta: Delta, queue) -> Delta:
    """One message for every delta already waiting (a slow client gets fewer, larger ones)."""
    while delta.finish_reason is None and not queue.empty():
        more = queue.get_nowait()
        delta = Delta(
            delta.token_ids + more.token_ids, delta.text + more.text, more.finish_reason, more.error
        )
    return delta


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)
