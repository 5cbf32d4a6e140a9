"""The typed messages between the router and an engine instance, through Ray.

``Attempt`` (router -> instance): one try at one request. ``Update`` (instance ->
router): a request's new tokens (with their ``Logprobs`` when the request asked), its
end, or a failure, batched per engine step (``EngineWorker.poll``). ``CacheCursor``
(consumer -> instance) and ``CacheDelta`` (instance -> consumer): what the instance's
prefix cache holds, as changes since the consumer's last poll (instance/logs.py).
``Polled`` is one poll's answer. No positional tuples cross the process boundary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.engine.outputs import Logprobs, RequestOutput
from pdserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # the router imports these messages without the engine's runtime
    from pdserve.engine.llm_engine import LLMEngine


def attempt_id(request_id: str, attempt: int, serial: str) -> str:
    """The id of a request's ``attempt``-th try (0 first); ``serial`` is unique per try
    within the router's life (its incarnation and a counter), so an id is never reused,
    even when a client reuses a request id."""
    return f"{request_id}#{attempt}.{serial}"


@dataclass(frozen=True)
class Attempt:
    """One try at running a request.

    ``id`` names the request on the instances, its KV transfer and its updates:
    ``attempt_id(...)``, new for every try, so that anything late from an abandoned try
    (or an abort of a finished one) can never be taken for a later try's. A co-located
    instance reads ``id``, ``prompt_ids``, ``params`` and
    ``consumer``; a decode instance's ``reserve`` also ``prefill_tp`` (which prefill ranks
    send which heads) and ``prefill`` (the instance that will send the KV: its receiver
    takes bytes of this transfer from no other); a prefill instance's ``prefill`` also
    ``destination`` (the decode instance's answer to ``reserve``, opaque here: the router
    never reads it) and ``decode`` (that instance's name, for messages).

    A request of n choices (``params.n``) names the attempts of choices 1 .. n - 1 in
    ``choices``: they fork from this one once its prompt is computed (where its KV
    lands, when disaggregated: a prefill instance draws their first tokens and sends
    the prompt's KV once), each then a request of its own under its attempt id, its
    updates to the same consumer (engine/choices.py).

    ``context`` is opaque to the instances: they hand it back, with the attempt, to a
    consumer that reconnects under the same name (``LiveAttempt``).

    Every instance also reads ``delivered`` and ``delivered_chars``: a request resumed
    after an earlier attempt died mid-stream carries the token ids and the number of
    text characters (code points) its client already received; the instance generates
    only what follows them, exactly what an uninterrupted run would have (docs/serving.md,
    "Resuming a request"). A decode instance reserves blocks for prompt + delivered; a
    prefill instance prefills prompt + delivered.
    """

    id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    consumer: str  # whose outbox on the instance gets its updates
    prefill_tp: int = 1
    prefill: str = ""
    decode: str = ""
    destination: bytes = b""
    delivered: tuple[int, ...] = ()
    delivered_chars: int = 0
    choices: tuple[str, ...] = ()
    # the router's own record of the request (msgpack; what it needs to rebuild the
    # request's stream after a restart, router/rebuild.py): never read by an instance
    context: bytes = b""

    def queue_in(self, engine: LLMEngine, hand_off: bool = False) -> None:
        """Queue this attempt's prompt (and what its client already has) in ``engine``
        under its id (``hand_off``: it leaves at its first token); ValueError when the
        engine refuses it."""
        engine.add_request(
            self.id,
            list(self.prompt_ids),
            self.params,
            self.delivered,
            self.delivered_chars,
            hand_off=hand_off,
            choice_ids=self.choices,
        )


@dataclass
class Update:
    """What an instance reports about one attempt (``request_id`` is ``Attempt.id``)."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # stop, length, abort: the request ended here
    error: str | None = None  # the instance failed the request
    # The error is a failed KV handoff (transfer cut, lease expired, peer gone): the
    # request may be redone on another prefill/decode pair.
    retryable: bool = False
    # The error is the request's own (its output cannot follow its guide): the router
    # refuses it as invalid instead of reporting an instance's failure.
    invalid: bool = False
    handed_off: bool = False  # prefill: every decode rank acknowledged the request's KV
    # phase times (wall clock, seconds), KV bytes moved, transfer seconds
    info: dict = field(default_factory=dict)
    # one per token of ``token_ids`` when the request asked for logprobs, else None
    logprobs: list[Logprobs] | None = None
    # the prompt's (None for its first token), on the request's first update when it
    # asked for them (``SamplingParams.prompt_logprobs``), else None
    prompt_logprobs: list[Logprobs | None] | None = None

    @classmethod
    def of(cls, request_id: str, out: RequestOutput, info: dict) -> Update:
        """Engine output ``out`` (its new tokens and text, its end, their logprobs) as
        attempt ``request_id``'s update."""
        return cls(
            request_id,
            out.new_token_ids,
            out.new_text,
            None if out.error else out.finish_reason,
            error=out.error,
            invalid=out.error is not None,
            info=info,
            logprobs=out.new_logprobs,
            prompt_logprobs=out.prompt_logprobs,
        )

    @property
    def final(self) -> bool:
        """The request is gone from the instance after this update."""
        return self.finish_reason is not None or self.error is not None or self.handed_off


@dataclass(frozen=True)
class CacheCursor:
    """Where a consumer's view of an instance's prefix cache stands: the ``epoch`` and
    ``seq`` of the last ``CacheDelta`` it applied (``CacheCursor()``: it has none yet)."""

    epoch: str = ""
    seq: int = 0


@dataclass
class CacheDelta:
    """How an instance's prefix cache changed since a consumer's ``CacheCursor``: block
    hashes (engine/block_hash.py) registered (``stored``) and evicted (``removed``).

    ``snapshot``: ``stored`` is every hash cached now and the consumer's view is replaced
    (it was new, behind the retained events, or of an earlier incarnation); else the
    events after the cursor, which the consumer applies with ``apply_to``. Either way the
    consumer's cursor becomes ``CacheCursor(epoch, seq)``.
    """

    epoch: str
    seq: int
    snapshot: bool = False
    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)

    @property
    def cursor(self) -> CacheCursor:
        return CacheCursor(self.epoch, self.seq)

    def apply_to(self, view: set[int]) -> None:
        """Bring ``view`` (the hashes cached as of the consumer's cursor) up to ``seq``.

        Events lose their order across ``stored`` and ``removed``, but a cache stores a
        hash only while it is absent and removes it only while present, so each hash's
        events alternate and its state follows from the net count: present after iff
        ``(present before) + stored - removed == 1``."""
        if self.snapshot:
            view.clear()
            view.update(self.stored)
            return
        net: dict[int, int] = {}
        for h in self.stored:
            net[h] = net.get(h, 0) + 1
        for h in self.removed:
            net[h] = net.get(h, 0) - 1
        for h, n in net.items():
            if (h in view) + n > 0:
                view.add(h)
            else:
                view.discard(h)


@dataclass
class Reserved:
    """A decode instance's answer to ``reserve`` sent up its update feed: the
    ``KVDestination`` (protobuf bytes) the prefill instance sends ``attempt_id``'s KV
    to; None with no ``error``: no room now; ``error``: the reservation failed (the
    exception's type and message), nothing is held."""

    attempt_id: str
    destination: bytes | None = None
    error: str | None = None


@dataclass
class LiveAttempt:
    """An attempt an instance holds for a consumer, as it hands it back when that
    consumer reconnects (instance/feed.py, "Rejoining"): the ``attempt`` as sent, what it
    produced so far (``token_ids`` and ``text`` after ``attempt.delivered``; ``marks``:
    ``[tokens, chars]`` at the end of each update, where the consumer's deltas can
    have ended) and how it ended, if it did. ``state``: ``pending`` (no token yet:
    reserved, prefilling or queued), ``running``, ``finished`` (``finish_reason``),
    ``failed`` (``error``; ``retryable`` as ``Update``'s) or ``handed_off`` (a
    prefill-side attempt whose KV the decode instance acknowledged)."""

    attempt: Attempt
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    marks: list[list[int]] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    retryable: bool = False
    handed_off: bool = False

    @property
    def state(self) -> str:
        if self.error is not None:
            return "failed"
        if self.finish_reason is not None:
            return "finished"
        if self.handed_off:
            return "handed_off"
        return "running" if self.token_ids else "pending"

    @property
    def final(self) -> bool:
        return self.state in ("finished", "failed", "handed_off")

    def record(self, update: Update) -> None:
        """Fold one of the attempt's updates in (on the instance, as it goes out)."""
        if update.token_ids or update.text:
            self.token_ids += update.token_ids
            self.text += update.text
            self.marks.append([len(self.token_ids), len(self.text)])
        if update.finish_reason is not None:
            self.finish_reason = update.finish_reason
        if update.error is not None:
            self.error, self.retryable = update.error, update.retryable
        self.handed_off = self.handed_off or update.handed_off


@dataclass
class Polled:
    """One ``EngineWorker.poll``: the consumer's updates, the instance's ``stats()``, its
    prefix cache's changes when the consumer passed a ``CacheCursor`` (else None), and
    the answers to the ``reserve``s it sent up its feed. ``live``: on the first frame of
    a feed connection only (else None), the attempts the instance still holds for the
    consumer (instance/feed.py, "Rejoining"); the updates of this and later frames
    follow what they hold."""

    updates: list[Update]
    stats: dict
    cache: CacheDelta | None = None
    reserved: list[Reserved] = field(default_factory=list)
    live: list[LiveAttempt] | None = None
