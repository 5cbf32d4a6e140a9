"""One request's life at the router as its client sees it: its output queue, its clock
(``Clock``), the tokens delivered, its final usage and timings (plain dataclasses; each
front end renders them in its own wire format). Its attempts are
router/attempt_record.py's.

TTFT, TPOT and e2e come from the router's clock (``time.monotonic``): arrival is
stamped when the request reaches a front end, first/last token when their batches
reach the router.

Phase times (``Phases``) mix the router's and the instances' wall clocks
(``time.time``) and are reported relative to the arrival's wall-clock stamp.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from pdserve.engine.block_hash import block_hashes
from pdserve.engine.outputs import Logprobs
from pdserve.engine.sampling_params import SamplingParams
from pdserve.router.attempt_record import AttemptRecord
from pdserve.router.request import Refusal, Refused


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


_PHASES = ("prefill_start", "prefill_end", "transfer_start", "transfer_end", "decode_start")


@dataclass
class Delta:
    """New output of a request. ``logprobs``: None unless the request asked for them
    (``params.logprobs``); then one per token of ``token_ids``, in order.
    ``prompt_logprobs``: the prompt's (None for its first token), on the request's first
    delta with tokens when it asked (``params.prompt_logprobs``), else None."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    error: str | None = None  # set when the instance failed the request
    refused: Refused | None = None  # set when the router gave up on it (``read`` raises it)
    logprobs: list[Logprobs] | None = None
    prompt_logprobs: list[Logprobs | None] | None = None

    @classmethod
    def failed(cls, error: str, invalid: bool) -> Delta:
        """The end of a request whose attempt failed: an instance's failure (``error``),
        or with ``invalid`` the request's own fault, refused as INVALID (its output cannot
        follow its guide: a retry elsewhere would end the same)."""
        if invalid:
            return cls([], "", refused=Refused(Refusal.INVALID, error))
        return cls([], "", "error", error)

    @property
    def last(self) -> bool:
        """Nothing follows it: the request finished, failed or was given up on."""
        return self.finish_reason is not None or self.error is not None or self.refused is not None


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    # prompt tokens whose KV was not computed for this request: a prefix cache hit on the
    # instance that computed the prompt (docs/serving.md, "Cached tokens")
    cached_tokens: int = 0

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
    kv_cached_tokens: int = 0  # disaggregated: prompt tokens whose KV decode held (not sent)
    transfer_ms: float = 0.0
    attempts: int = 1
    phases: Phases = field(default_factory=Phases)
    # speculative decoding (its last attempt's): guessed tokens verified, those accepted,
    # the decode steps that verified some; tokens per such step: 1 + accepted / steps
    guessed_tokens: int = 0
    accepted_tokens: int = 0
    guess_steps: int = 0


@dataclass(eq=False)
class RequestStream:
    """One admitted request until its final delta: the client's half of it.

    The placement delivers its instances' output (``deliver``, on the router's event
    loop); a front end reads it (``read``) until a delta has a finish reason or an
    error, then reports ``usage()`` and ``timings()``.

    Memory, whatever the reader's pace: deliveries not yet read are merged into one
    waiting delta, so an unread stream holds at most its own output (``max_tokens``
    token ids and their text) and one delta object.

    Who writes what: the request's facts (id, prompt, params, owner, front, the clock's
    arrival) are set when it is opened (the core) or rebuilt (router/rebuild.py) and
    never change; the output, the delivered tokens and the clock's token stamps only by
    ``deliver`` (and a rebuilt stream's resume point by ``rewind``); where it was sent
    by ``sent_to`` and what it waits for by ``waits_for`` (the placement, the core, the
    rebuild); ``timers`` by the core and the rebuild. The placement's half, which
    attempt is current and on which instances, is ``attempt`` (router/attempt_record.py).
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    clock: Clock = field(default_factory=Clock)
    owner: str = ""  # the API key's owner (router/auth.py) that may abort it
    # how its front end renders it, for a restarted router's resume (router/rebuild.py):
    # HTTP's {"api": "chat" | "completions", "include_usage": bool}; {} for gRPC
    front: dict = field(default_factory=dict)
    attempt: AttemptRecord = field(default_factory=AttemptRecord)
    instances: list[str] = field(default_factory=list)  # where it was sent (``sent_to``)
    finished: bool = False
    # how it ended, set with ``finished`` by its last delta: a finish reason (stop,
    # length, abort), "error" (an instance failed it) or "refused" (the router gave up)
    outcome: str | None = None
    waiting: Delta | None = None  # delivered, not yet read (every such delivery merged)
    timers: list[asyncio.TimerHandle] = field(default_factory=list)  # the core's deadlines
    on_first_token: Callable[[], None] | None = None  # the core's load estimate
    _delivered: asyncio.Event = field(default_factory=asyncio.Event, repr=False)  # waiting set
    # what the client has (or has queued): the resume state of a migrated attempt
    token_ids: list[int] = field(default_factory=list)
    text_chars: int = 0
    # progress (router/stall.py): what the placed stream waits for now ("" before its
    # first placement: the admission queue's timeout bounds that wait) and since when
    waiting_for: str = ""
    progress_at: float = 0.0
    # a stream a restarted router rebuilt (router/rebuild.py): no reader until its client
    # resumes it (``claimed``); its text from the rebuild's first known token on, and
    # where the deltas its client may have read ended: token count -> chars of ``text``
    claimed: bool = True
    text: str | None = None
    marks: dict[int, int] = field(default_factory=dict)
    _hashes: dict[int, list[int]] = field(default_factory=dict, repr=False)  # by block size
    # a request of n choices: choice 0 is this stream, these its choices 1 .. n - 1, each
    # a stream of its own (seeded seed + i), opened, read and cancelled with it; they ride
    # with its first attempt, forked where its prompt is computed (router/placement.py)
    riders: list[RequestStream] = field(default_factory=list, repr=False)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def waits_for(self, what: str) -> None:
        """The stream made progress and now waits for ``what`` (a phrase naming the
        instance and the event: "decode-0 to reserve blocks for the KV")."""
        self.waiting_for, self.progress_at = what, time.monotonic()

    def sent_to(self, instance: str) -> None:
        self.instances.append(instance)
        self.clock.placed()

    def deliver(self, delta: Delta) -> None:
        """A batch of this request's tokens arrived from its instance."""
        if self.finished:
            return
        now = time.monotonic()
        if delta.prompt_logprobs is not None and not self.token_ids:
            # the first tokens' attempt computed them (a resumed one has none: its client
            # has them); a later copy, from an attempt redone after them, is dropped
            self.waiting = self.waiting or Delta([], "")
            self.waiting.prompt_logprobs = delta.prompt_logprobs
        if delta.token_ids:
            first = self.clock.tokens(len(delta.token_ids), now)
            if first and self.on_first_token is not None:
                self.on_first_token()
            self.progress_at = now
            self.token_ids += delta.token_ids
        if delta.last:
            self.finished = True
            self.outcome = (
                "refused"
                if delta.refused is not None
                else "error"
                if delta.error is not None
                else delta.finish_reason
            )
        if self.waiting is None:  # ours: later deliveries extend it in place
            self.waiting = Delta([], "")
        merged = self.waiting
        merged.token_ids += delta.token_ids
        merged.text += delta.text
        if delta.logprobs is not None:  # every token's, when the request asked
            merged.logprobs = [] if merged.logprobs is None else merged.logprobs
            merged.logprobs += delta.logprobs
        self.text_chars += len(delta.text)
        if self.text is not None:
            self.text += delta.text
        merged.finish_reason, merged.error, merged.refused = (
            delta.finish_reason,
            delta.error,
            delta.refused,
        )
        self._delivered.set()

    async def read(self) -> Delta:
        """The next delta for the client: every delivery since the previous read, merged.

        Raises ``Refused`` when the router gave up on the request (its deadline, the
        queue's timeout), after handing out the tokens delivered before that."""
        await self._delivered.wait()
        delta, self.waiting = self.waiting, None
        assert delta is not None  # _delivered is set only with a delta waiting
        self._delivered.clear()
        if delta.refused is not None:
            if delta.token_ids:  # the tokens first; the refusal on the next read
                self.waiting = Delta([], "", refused=delta.refused)
                self._delivered.set()
                return Delta(delta.token_ids, delta.text, logprobs=delta.logprobs)
            raise delta.refused
        return delta

    def rewind(self, after: int) -> None:
        """A client resumes this rebuilt stream having its first ``after`` tokens: its next
        ``read`` gives every token after them (and their text), with the end if it came.
        Raises ``Refused`` (INVALID) when ``after`` is not where one of its deltas ended
        (the text could not be split there)."""
        start = self.marks.get(after)
        if start is None or self.text is None or after > len(self.token_ids):
            known = ", ".join(str(n) for n in sorted(self.marks)[:8])
            raise Refused(
                Refusal.INVALID,
                f"after={after}: request {self.request_id!r} can be resumed after one of "
                f"{len(self.marks)} token counts ({known}{', ...' if len(self.marks) > 8 else ''})",
            )
        ended = self.waiting or Delta([], "")
        self.waiting = Delta(
            self.token_ids[after:],
            self.text[start:],
            ended.finish_reason,
            ended.error,
            ended.refused,
        )
        self.claimed = True
        self._delivered.set()

    def block_hashes(self, block_size: int) -> list[int]:
        """The prompt's full-block hashes (engine/block_hash.py), computed once per size."""
        if block_size not in self._hashes:
            self._hashes[block_size] = block_hashes(self.prompt_ids, block_size)
        return self._hashes[block_size]

    def usage(self) -> Usage:
        """Token counts; ``cached_tokens`` as the last attempt's prompt instance reported
        it (``Reported.cached_tokens``), at most the prompt (a resumed attempt's hit may
        cover tokens already delivered)."""
        cached = min(self.attempt.reported.cached_tokens, len(self.prompt_ids))
        return Usage(len(self.prompt_ids), self.num_tokens, cached)

    def timings(self) -> Timings:
        clock = self.clock
        end = clock.last_token_at or time.monotonic()
        first = clock.first_token_at
        gaps = self.num_tokens - 1
        since = clock.since_arrival_ms
        reported = self.attempt.reported
        phases = reported.phases
        return Timings(
            queue_ms=ms((clock.dispatched_at or end) - clock.arrival),
            ttft_ms=ms(first - clock.arrival) if first is not None else 0.0,
            tpot_ms=ms((end - first) / gaps) if first is not None and gaps > 0 else 0.0,
            e2e_ms=ms(end - clock.arrival),
            instances=list(self.instances),
            kv_bytes=reported.kv_bytes,
            kv_cached_tokens=reported.kv_cached_tokens,
            transfer_ms=ms(reported.transfer_s),
            attempts=self.attempt.number + 1,
            guessed_tokens=reported.guesses[0],
            accepted_tokens=reported.guesses[1],
            guess_steps=reported.guesses[2],
            phases=Phases(
                queued=since(clock.placed_wall),
                **{name: since(phases.get(name)) for name in _PHASES},
                tokens=[since(t) for t in clock.token_walls],
                finish=since(clock.token_walls[-1] if clock.token_walls else None),
            ),
        )


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, Delta]]:
    """(index, delta) as each choice's stream gives them, until every one has ended;
    raises a choice's ``Refused`` when it comes (the others are not read on). A request
    of n choices is n streams (``riders``): what both front ends merge into their own
    responses."""
    if len(streams) == 1:  # one choice: read in place, no task between
        while True:
            delta = await streams[0].read()
            yield 0, delta
            if delta.last:
                return
    queue: asyncio.Queue[tuple[int, Delta | Refused]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        while True:
            try:
                delta = await stream.read()
            except Refused as e:
                await queue.put((i, e))
                return
            await queue.put((i, delta))
            if delta.last:
                return

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, got = await queue.get()
            if isinstance(got, Refused):
                raise got
            left -= got.last
            yield i, got
    finally:
        for task in tasks:
            task.cancel()
