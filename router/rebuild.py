"""A restarted router's view of the requests in flight, rebuilt from the instances
(docs/serving.md, "Router restarts and resuming").

The router stores its own record of each request in every ``Attempt`` it sends
(``Attempt.context``, msgpack: ``context``/``read_context``): the request's owner, its
arrival's wall-clock time, and what its front end needs to render the rest
(``RequestStream.front``). When a
router replica dies, the instances keep its requests running for
``router.rejoin_grace_s`` (instance/feed.py, "Rejoining"); the new incarnation connects
under the same consumer name and the first frame of each instance's feed hands back
every ``LiveAttempt`` it holds. ``Rebuild.take`` turns each into a ``RequestStream``:

- running (tokens produced) or finished on a co-located or decode instance: adopted as
  it is, the tokens produced so far already the stream's, the later updates following
  them (the feed's snapshot and its later frames do not overlap);
- failed with a retryable error: migrated as any failed attempt is (``RouterCore.migrate``);
  failed otherwise: ended with its error;
- pending (no token yet: reserved, landing, queued) on a co-located or decode instance:
  aborted there and placed again at the head of the queue, from the prompt and what was
  delivered before;
- the prefill side of a handoff (it carries a ``destination``): aborted unless it ended:
  its decode side says what becomes of the request.

A rebuilt stream has no reader until its client resumes it (``Rebuild.claim``, through
``RouterCore.resume``);
one not resumed within ``router.resume_retention_s`` is cancelled (its instances free
its blocks). Invariant: one stream per request id: a second attempt reported for a
request already rebuilt (another instance's, from before a migration) is aborted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace

import msgpack

from pdserve.instance.messages import Attempt, LiveAttempt
from pdserve.router.attempt_record import AttemptRecord
from pdserve.router.instances import Instance
from pdserve.router.request import Refusal, Refused
from pdserve.router.stream import Clock, Delta, RequestStream

log = logging.getLogger(__name__)


def context(stream: RequestStream) -> bytes:
    """The router's record of ``stream`` that rides in each of its attempts."""
    record = {
        "owner": stream.owner,
        "arrival_wall": stream.clock.arrival_wall,
        "front": stream.front,
    }
    return msgpack.packb(record, use_bin_type=True)


def read_context(blob: bytes) -> dict:
    """``context``'s record back (``owner``, ``arrival_wall``, ``front``); {} for an
    attempt that carries none."""
    if not blob:
        return {}
    record = msgpack.unpackb(blob, raw=False)
    return record if isinstance(record, dict) else {}


def request_id_of(attempt: Attempt) -> str:
    """The request an attempt is a try of (``instance.messages.attempt_id``'s inverse)."""
    return attempt.id.rsplit("#", 1)[0]


def attempt_number(attempt: Attempt) -> int:
    """The attempt's number within its request (0: the first try)."""
    tail = attempt.id.rsplit("#", 1)[-1]
    number = tail.split(".", 1)[0]
    return int(number) if number.isdigit() else 0


def stream_of(live: LiveAttempt) -> RequestStream:
    """The stream of ``live``'s request as the instance's report has it: its prompt,
    its sampling, its owner and arrival (as the context recorded them), and every token
    its client has or could have (those delivered before this attempt and those it
    produced), with the text of the latter; no attempt current yet."""
    a = live.attempt
    record = read_context(a.context)
    arrival_wall = float(record.get("arrival_wall", time.time()))
    stream = RequestStream(
        request_id_of(a),
        list(a.prompt_ids),
        replace(a.params, n=1),  # choice 0's: the others' streams are not rebuilt
        clock=Clock(time.monotonic() - max(0.0, time.time() - arrival_wall), arrival_wall),
        owner=str(record.get("owner", "")),
        attempt=AttemptRecord(number=attempt_number(a)),
    )
    front = record.get("front")
    stream.front = front if isinstance(front, dict) else {}
    stream.token_ids = list(a.delivered) + list(live.token_ids)
    stream.text_chars = a.delivered_chars + len(live.text)
    base = len(a.delivered)
    stream.text = live.text
    stream.marks = {base: 0, **{base + n: chars for n, chars in live.marks}}
    stream.claimed = False
    return stream


class Rebuild:
    """What a restarted router makes of each instance's ``LiveAttempt``s (the module
    docstring), and its rebuilt streams until their clients claim them; ``router`` is
    the core (``streams``, ``migrate``, ``requeue``, ``after_updates``, ``finish``)."""

    def __init__(self, router, retention_s: float):
        self.router, self.retention_s = router, retention_s
        self.rebuilt: dict[str, RequestStream] = {}  # by request id, not claimed yet

    def claim(self, request_id: str, after: int, owner: str) -> RequestStream:
        """The rebuilt stream of ``request_id``, owned by ``owner``, for a client that has
        its first ``after`` tokens: its next ``read`` gives the rest
        (``RequestStream.rewind``); claimed once. Raises ``Refused`` (INVALID) for an id
        not held for ``owner`` (never, already claimed, or past the retention) or an
        ``after`` it cannot resume at."""
        stream = self.rebuilt.get(request_id)
        if stream is None or stream.owner != owner:
            raise Refused(
                Refusal.INVALID,
                f"request_id={request_id!r}: no request of this key to resume (allowed: one "
                "a restarted router rebuilt, not resumed yet, within router."
                f"resume_retention_s={self.retention_s:g})",
            )
        stream.rewind(after)
        del self.rebuilt[request_id]
        return stream

    def _keep(self, stream: RequestStream) -> None:
        """Hold a rebuilt stream for its client, at most ``retention_s``; then it is taken
        out of the router and its instances."""
        self.rebuilt[stream.request_id] = stream
        loop = asyncio.get_running_loop()
        stream.timers.append(loop.call_later(self.retention_s, self._unclaimed, stream))

    def _unclaimed(self, stream: RequestStream) -> None:
        if self.rebuilt.get(stream.request_id) is stream:
            del self.rebuilt[stream.request_id]
            self.router.finish(stream)

    def take(self, inst: Instance, live: list[LiveAttempt]) -> None:
        ended: list[RequestStream] = []
        for a in live:
            if a.attempt.destination:  # the prefill side of a handoff
                if not a.final:
                    inst.abort([a.attempt.id])
                continue
            rid = request_id_of(a.attempt)
            if rid in self.router.streams or rid in self.rebuilt:
                if not a.final:
                    inst.abort([a.attempt.id])
                continue
            stream = stream_of(a)
            self._keep(stream)
            state = a.state
            if state == "finished":
                stream.deliver(Delta([], "", a.finish_reason))
                continue
            if state == "failed" and not a.retryable:
                stream.deliver(Delta([], "", "error", a.error))
                continue
            self.router.streams[rid] = stream
            if state == "running":
                self._adopt(inst, stream, a.attempt)
            elif state == "failed":
                if not self.router.migrate(stream, a.error or "failed"):
                    ended.append(stream)
            else:  # pending: placed again, from what was delivered before
                inst.abort([a.attempt.id])
                stream.waits_for("an instance to continue on (its router was restarted)")
                self.router.requeue(stream)
        if live:  # a router's first start hears of none: nothing to warn about
            log.warning(
                "router rebuilt %d requests from %s (%d attempts reported)",
                sum(1 for a in live if not a.attempt.destination),
                inst.name,
                len(live),
            )
        self.router.after_updates(ended)

    @staticmethod
    def _adopt(inst: Instance, stream: RequestStream, attempt: Attempt) -> None:
        """``inst`` streams ``attempt``: it is the stream's current attempt again."""
        stream.attempt.adopt(
            attempt.id, (attempt.prefill, inst.name) if attempt.prefill else (inst.name,)
        )
        stream.instances.append(inst.name)
        stream.clock.adopted()
        inst.hold(stream)
        stream.waits_for(f"tokens from {inst.name}")
