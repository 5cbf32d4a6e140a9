"""One engine instance behind a Ray actor: requests in, updates out.

The cluster wraps a worker class with ``ray.remote`` (a threaded actor), so its methods
run on a small thread pool while a background thread runs the engine's step loop.
Callers never touch the engine: ``add``/``abort`` go into an inbox the loop drains
before each step as typed messages (instance/inbox.py), each applied by the handler its
type names in ``self._ops`` (``on_loop`` runs a function there and returns its result), and
updates go into one outbox per consumer (the router, a benchmark) that ``poll`` hands
over in one batch: everything produced since the last poll, so a busy instance costs
its consumer one call per step at most, never one per token. The router calls neither
``poll`` nor ``add`` through Ray: it takes the same batches down the update feed and
sends ``add``s and ``abort``s (and a component's ``prefill``s and ``reserve``s) up it
(``open_feed``, instance/feed.py), which costs the step's threads far less. A consumer
that passes a ``CacheCursor`` also gets the prefix cache's changes since its last poll
(instance/logs.py): the block hashes the router routes by.

Every step is the engine's mixed step, prompt chunks piggybacked on the running decodes
(engine/scheduler.py). One class serves every role: a role is the components the worker
holds (instance/component.py), chosen by the cluster (cluster/actors.py): none for a
co-located instance, the sending one (prefill_worker/) for a prefill instance, the
receiving one (decode_worker/) for a decode instance, both for a decode instance that
prefills for its peers. It lives in instance/, which both pools import, so that the
pools never import each other. No Ray import: the cluster wraps it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import traceback
import uuid
from collections import OrderedDict, defaultdict, deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from pdserve.engine.config import EngineConfig
from pdserve.engine.outputs import StepFailed
from pdserve.engine.prefilled import LastChunkHook, Prefilled
from pdserve.engine.scheduler import StepShape
from pdserve.instance.component import Component
from pdserve.instance.feed import ATTEMPT_COMMANDS, FeedServer, FeedTicket
from pdserve.instance.inbox import Abort, Add, Call, ConsumerExpired, ConsumerLeft
from pdserve.instance.logs import CacheLog, StepLog
from pdserve.instance.messages import Attempt, CacheCursor, LiveAttempt, Polled, Reserved, Update

log = logging.getLogger(__name__)
K = TypeVar("K")
V = TypeVar("V")


ROLES = ("colocated", "prefill", "decode")


class EngineWorker:
    def __init__(
        self,
        name: str,
        model: str,
        engine_config: dict,
        num_threads: int,
        *,
        role: str = "colocated",
        components: tuple[type[Component], ...] = (),
        kv: dict | None = None,
        parallel: dict | None = None,
        feed: dict | None = None,
    ):
        """``role``: what ``ready`` reports, one of ``ROLES``; ``components``: the role's
        parts (instance/component.py), each made with ``kv``, the KV transfer's
        configuration (``kv_transfer``'s keys, the secret, ``bind`` and ``advertise``),
        which a worker with components needs. ``feed``: ``{"bind": interface,
        "advertise": address}`` of the update feed's listener (instance/feed.py; None:
        127.0.0.1, for instances made outside a cluster),
        and optionally ``"rejoin_grace_s"``: how long a departed consumer's requests are
        kept for it to reconnect (``consumer_left``; absent or 0: dropped at once).
        ``parallel``: ``{"size": N, "address": host:port, "bind": interface, "secret":
        the cluster's, "ranks": [handles]}`` makes this rank 0 of a tensor-parallel
        instance: it serves the world's rendezvous on ``bind`` at that port, advertised
        as ``address``, to ranks that prove ``secret``;
        ranks 1..N-1 are the given actors (``instance.rank_actor.RankActor``)."""
        if role not in ROLES:
            raise ValueError(f"role={role!r}: one of {list(ROLES)}")
        if components and kv is None:
            names = [c.__name__ for c in components]
            raise ValueError(f"kv=None: the components {names} of {name!r} need the KV config")
        # torch and the engine load here, not with this module: every process that
        # holds a handle to the actor (the router, the supervisor) loads its class
        import torch

        from pdserve.engine.llm_engine import LLMEngine
        from pdserve.engine.parallel import SINGLE, TensorParallel, serve_store

        torch.set_num_threads(max(1, num_threads))
        self.threads = torch.get_num_threads()
        self.name, self.role = name, role
        config = EngineConfig(**engine_config)
        tp, self.ranks = SINGLE, []
        if parallel is not None and parallel["size"] > 1:
            host, port = parallel["address"].rsplit(":", 1)
            secret = parallel["secret"]
            self._store, address = serve_store(secret, parallel["bind"], int(port), host)
            tp = TensorParallel.join(address, 0, parallel["size"], secret, config.device)
            self.ranks = list(parallel["ranks"])
        self.engine = LLMEngine(model, config, tp)
        self.engine.model.pack_panels()
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # the loop waits here for requests
        # where each consumer's poll waits for its updates (under _lock): a step wakes only
        # the consumers it gave updates to, or every one when the prefix cache changed
        self._waits: dict[str, threading.Condition] = {}
        self._inbox: deque[Any] = deque()  # instance/inbox.py's messages
        self._outboxes: dict[str, list[Update]] = defaultdict(list)
        self._reserved: dict[str, list[Reserved]] = defaultdict(list)  # answers, per consumer
        self._consumer: dict[str, str] = {}  # request id -> whose outbox
        # aborts that arrived before their request (a threaded actor may reorder calls)
        self._early_aborts: OrderedDict[str, None] = OrderedDict()
        self._totals = {"requests_total": 0, "tokens_total": 0, "steps_total": 0}
        # speculative decoding's guesses verified and accepted, summed over ended requests
        self._totals.update(guessed_tokens_total=0, accepted_tokens_total=0)
        self._steps = StepLog()
        self._cache_log = CacheLog(retain=self.engine.kv_view().num_blocks)  # under _lock
        self._last_step: list[float] = []  # the latest ``step_log`` row, in ``stats()``
        # called on the step loop after each step, with its shape, its seconds (as
        # ``step_log`` has them) and ``stats()`` after it (cluster/instance_metrics.py)
        self.step_observers: list[Callable[[StepShape, float, dict], None]] = []
        # each inbox message's type and its one handler (a component adds its own)
        self._ops: dict[type, Callable[[Any], list[Update]]] = {
            Call: lambda m: self._op_call(m.future, m.fn, m.args),
            Abort: lambda m: self._op_abort(list(m.attempt_ids)),
            Add: lambda m: self._op_add(m.attempt),
            ConsumerLeft: lambda m: self._op_consumer_left(m.consumer),
            ConsumerExpired: lambda m: self._op_consumer_expired(m.consumer, m.token),
        }
        # rejoining (instance/feed.py): the attempts sent up a feed and what they produced,
        # kept while held and ``rejoin_grace_s`` after their end (under _lock); none
        # kept with a grace of 0
        feed = feed or {"bind": "127.0.0.1", "advertise": "127.0.0.1"}
        self._rejoin_grace_s: float = feed.get("rejoin_grace_s", 0.0)
        self._live: dict[str, LiveAttempt] = {}
        self._ended: deque[tuple[float, str]] = deque()  # (monotonic end, attempt id)
        self._departed: dict[str, object] = {}  # consumer -> the token of its departure
        # what a consumer may send up its feed (instance/feed.py): command -> what applies it
        commands: dict[str, Callable[[Any], None]] = {"add": self.add, "abort": self.abort}
        self._calls: dict[str, Callable[..., Any]] = {}  # the role's actor calls
        self.components = [c(self, kv or {}) for c in components]
        for c in self.components:
            self._take(c, commands)
        self._snapshot = self._stats()
        self._stopping = False
        commands = {kind: self._command(kind, fn) for kind, fn in commands.items()}
        self._feed = FeedServer(
            name,
            self.poll,
            commands,
            feed["bind"],
            feed["advertise"],
            self.consumer_left,
            self.consumer_joined,
        )
        self._busy_since: float | None = None  # monotonic start of the work under way
        self._loop = threading.Thread(target=self._run, name=f"{name}-steps", daemon=True)
        self._loop.start()

    def _take(self, c: Component, commands: dict[str, Callable[[Any], None]]) -> None:
        """Add component ``c``'s handlers, feed commands and calls to the worker's."""
        _merge(self._ops, c.handlers(), f"{self.name}: {type(c).__name__}")
        _merge(commands, c.feed_commands(), f"{self.name}: {type(c).__name__}")
        _merge(self._calls, c.calls(), f"{self.name}: {type(c).__name__}")

    # ---- calls (from the router or a benchmark, through the actor handle) ----

    def ready(self) -> dict:
        """Facts the router needs; answering at all means the model is loaded."""
        e = self.engine
        facts = {
            "name": self.name,
            "role": self.role,
            "pid": os.getpid(),
            "threads": self.threads,
            "max_context": e.max_context,
            "vocab_size": e.model_config.vocab_size,
            "num_blocks": e.kv_view().num_blocks,
            "block_size": e.kv_view().block_size,
            "max_batch_size": e.config.max_batch_size,
            "max_batch_tokens": e.config.max_batch_tokens,
            "mixed_prefill_tokens": e.config.mixed_prefill_tokens,
            "tensor_parallel": e.model.tp.size,
            # this rank's KV cache bytes per token (a replicated MLA latent counts whole);
            # a decode instance adds ``kv_bytes_per_token``, what a handoff moves per token
            "kv_cache_bytes_per_token": e.kv_view().bytes_per_token,
        }
        for c in self.components:
            facts.update(c.ready())
        return facts

    def add(self, attempt: Attempt) -> None:
        """Queue a request; its updates go to ``attempt.consumer``'s outbox."""
        self.post(Add(attempt))

    def abort(self, request_ids: list[str]) -> None:
        """Drop requests (queued, running or not yet arrived) and free their blocks."""
        self.post(Abort(tuple(request_ids)))

    def prefill(self, attempt: Attempt) -> None:
        """Prefill ``attempt``'s prompt and send its KV to ``attempt.destination`` (the
        reservation of the decode instance ``attempt.decode``): the sending component's."""
        self._role_call("prefill", attempt)

    def reserve(self, attempt: Attempt) -> bytes | None:
        """Hold blocks for ``attempt``'s KV; the ``KVDestination`` (protobuf bytes) to send
        it to, or None when there is no room: the receiving component's."""
        return self._role_call("reserve", attempt)

    def rank_acked(self, transfer_id: str, rank: int, nbytes: int, error: str | None) -> None:
        """Rank ``rank``'s ENDs of a transfer were answered (or failed): pushed by it."""
        self._role_call("rank_acked", transfer_id, rank, nbytes, error)

    def rank_landed(self, transfer_id: str, rank: int, nbytes: int, error: str | None) -> None:
        """Rank ``rank``'s part of a transfer landed (or failed): pushed by that rank."""
        self._role_call("rank_landed", transfer_id, rank, nbytes, error)

    def _role_call(self, call: str, *args: Any) -> Any:
        serve = self._calls.get(call)
        if serve is None:
            raise ValueError(
                f"{self.name}: call {call!r} is not served by a {self.role} instance "
                f"(its calls: {sorted(self._calls)})"
            )
        return serve(*args)

    def consumer_left(self, consumer: str) -> None:
        """``consumer`` is gone (its update feed ended): its requests run on and their
        updates accumulate for ``rejoin_grace_s``; then (at once with a grace of 0) they
        are dropped, freeing their blocks, with its outbox. A ``consumer_joined`` within
        the grace keeps them."""
        if self._rejoin_grace_s <= 0:
            self.post(ConsumerLeft(consumer))
            return
        token = object()
        with self._lock:
            self._departed[consumer] = token
        timer = threading.Timer(
            self._rejoin_grace_s, self.post, (ConsumerExpired(consumer, token),)
        )
        timer.daemon = True
        timer.start()
        log.warning(
            "%s: consumer %r left; keeping its requests for %g s (router.rejoin_grace_s)",
            self.name,
            consumer,
            self._rejoin_grace_s,
        )

    def consumer_joined(self, consumer: str) -> list[LiveAttempt]:
        """A feed connection of ``consumer`` starts: the attempts held for it (what a
        departed consumer left running, its grace cancelled), its outbox emptied at the
        same instant: the updates after it are what follows these."""
        with self._lock:
            self._departed.pop(consumer, None)
            self._outboxes.pop(consumer, None)
            self._reserved.pop(consumer, None)
            self._forget_ended()
            return [
                LiveAttempt(
                    **{**a.__dict__, "token_ids": list(a.token_ids), "marks": list(a.marks)}
                )
                for a in self._live.values()
                if a.attempt.consumer == consumer
            ]

    def _command(self, kind: str, apply: Callable[[Any], None]) -> Callable[[Any], None]:
        """The feed's handler of ``kind``: ``apply``, which for an attempt first compiles
        its guide, on the feed's thread rather than the step loop's (an error is the step
        loop's to report when it admits the attempt), and records it for rejoining (when
        there is a grace)."""
        if kind not in ATTEMPT_COMMANDS:
            return apply

        def received(attempt: Attempt) -> None:
            with contextlib.suppress(ValueError):
                self.engine.prepare_guide(attempt.params)
            if self._rejoin_grace_s > 0:
                with self._lock:
                    self._live[attempt.id] = LiveAttempt(attempt)
            apply(attempt)

        return received

    def _forget_ended(self) -> None:
        """Drop the records of attempts that ended more than the grace ago (under _lock)."""
        horizon = time.monotonic() - self._rejoin_grace_s
        while self._ended and self._ended[0][0] < horizon:
            self._live.pop(self._ended.popleft()[1], None)

    def poll(self, consumer: str, timeout_s: float, cache: CacheCursor | None = None) -> Polled:
        """Everything produced for ``consumer`` since its last poll, and with ``cache`` the
        prefix cache's changes since that cursor (waits up to timeout_s for either)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            log = self._cache_log
            wait = self._waits.get(consumer)
            if wait is None:
                wait = self._waits[consumer] = threading.Condition(self._lock)
            while not (
                self._outboxes.get(consumer)
                or self._reserved.get(consumer)
                or log.has_news(cache)
                or self._stopping
            ):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                wait.wait(left)
            items = self._outboxes.pop(consumer, [])
            reserved = self._reserved.pop(consumer, [])
            return Polled(items, dict(self._snapshot), log.since(cache), reserved)

    def open_feed(self, consumer: str, cache: CacheCursor | None = None) -> FeedTicket:
        """A ticket for one connection down which this instance pushes, for ``consumer``,
        what ``poll`` would answer, each time there is news, and up which it takes
        ``add``s and ``abort``s (instance/feed.py): the cheap way to drive a busy
        instance. ``cache``: the consumer's cursor to start from (None: no prefix cache
        changes)."""
        return self._feed.open(consumer, cache)

    def stats(self) -> dict:
        with self._lock:
            return dict(self._snapshot)

    def ping(self) -> dict:
        """Liveness for the supervisor (cluster/supervisor.py), answered off the step
        loop: ``busy_s`` is how long the loop has been inside one round of ops and step
        (0 while it waits for work), so a step stuck in a collective shows as it grows."""
        since = self._busy_since
        return {"pid": os.getpid(), "busy_s": 0.0 if since is None else time.monotonic() - since}

    def step_log(self) -> list[list[float]]:
        """The steps served since the last call: ``[prefill_tokens, sum_sq, decodes,
        context, seconds]`` each (``instance.logs.StepLog``)."""
        return self._steps.take()

    def check_integrity(self) -> dict:
        """Run the engine's ``check_integrity()`` between steps; the block counts."""

        def check() -> dict:
            self.engine.check_integrity()
            s = self.engine.stats()
            return {"free_blocks": s.free_blocks, "total_blocks": s.total_blocks}

        return self.on_loop(check)

    def on_loop(self, fn, *args):
        """Run ``fn(*args)`` on the step loop, between steps; its result (or exception)."""
        future: Future = Future()
        self.post(Call(future, fn, args))
        return future.result()

    def stop(self) -> None:
        self._feed.close()
        with self._lock:
            self._stopping = True
            self._work.notify_all()
            self._wake(self._waits)
        self._loop.join(timeout=10)
        self.engine.close()
        for c in self.components:
            c.close()

    # ---- the step loop (its own thread; the only code that touches the engine) ----
    # (``post``, ``answer``, ``take_early_abort``, ``owns``, ``bind_consumer``,
    # ``abort_now``, ``count`` and ``fail`` are the components' host surface too)

    def post(self, op: Any) -> None:
        """Put ``op`` (an instance/inbox.py message) in the inbox; from any thread."""
        with self._lock:
            self._inbox.append(op)
            self._work.notify()

    def _run(self) -> None:
        while True:
            with self._lock:
                while not (self._inbox or self._stopping or self.engine.has_unfinished_requests()):
                    self._work.wait()  # every event reaches the loop as an op in the inbox
                if self._stopping:
                    return
                ops = list(self._inbox)
                self._inbox.clear()
            self._busy_since = time.monotonic()
            started = time.perf_counter()
            produced = [u for op in ops for u in self._apply(op)]
            step = None
            if self.engine.has_unfinished_requests():
                if produced:  # out before the step, which may be a long prompt chunk: a
                    # landed request's first token, an op's error do not wait for it
                    with self._lock:
                        self._wake(self._route(produced))
                    produced = []
                produced += self._step()
                if self.engine.last_shape is not None:  # recorded before its updates go out
                    step = (self.engine.last_shape, time.perf_counter() - started)
                    self._last_step = self._steps.record(*step)
            produced += self._orphaned()
            cache_events = self.engine.take_cache_events()
            with self._lock:
                self._cache_log.record(cache_events)
                fed = self._route(produced)
                self._snapshot = snapshot = self._stats()
                self._wake(self._waits if cache_events.stored or cache_events.removed else fed)
            self._busy_since = None
            if step is not None:
                for observe in self.step_observers:
                    observe(*step, snapshot)

    def _orphaned(self) -> list[Update]:
        """Choices whose request ended here before they forked (engine/choices.py): each
        fails, retryable (the router runs it alone)."""
        if not self.engine.orphaned:  # the common case, each turn of the loop
            return []
        orphans, self.engine.orphaned = self.engine.orphaned, []
        why = "its request ended on {} before its first token, so it did not fork there"
        return [Update(c, error=why.format(self.name), retryable=True) for c in orphans]

    def _route(self, updates: list[Update]) -> set[str]:
        """Each update into its consumer's outbox (under ``_lock``); the consumers given
        some."""
        fed = set()
        for update in updates:
            live = self._live.get(update.request_id)
            if live is not None and not live.final:
                live.record(update)
                if live.final:
                    self._ended.append((time.monotonic(), update.request_id))
                    self._forget_ended()
            consumer = self._consumer.get(update.request_id)
            if consumer is not None:
                self._outboxes[consumer].append(update)
                fed.add(consumer)
            if update.final:
                self._consumer.pop(update.request_id, None)
        return fed

    def answer(self, consumer: str, reserved: Reserved) -> None:
        """Hand ``consumer`` an answer to its ``reserve`` with its next batch (a refusal
        or a failure ends the attempt here: its rejoining record goes)."""
        with self._lock:
            if reserved.destination is None:
                self._live.pop(reserved.attempt_id, None)
            self._reserved[consumer].append(reserved)
            self._wake([consumer])

    def _wake(self, consumers) -> None:
        """Wake the polls of these consumers (under ``_lock``)."""
        for consumer in consumers:
            wait = self._waits.get(consumer)
            if wait is not None:
                wait.notify_all()

    def _apply(self, op: Any) -> list[Update]:
        return self._ops[type(op)](op)

    def _op_call(self, future: Future, fn, args: tuple) -> list[Update]:
        try:
            future.set_result(fn(*args))
        except Exception as e:  # the caller gets it
            future.set_exception(e)
        return []

    def _op_abort(self, request_ids: list[str]) -> list[Update]:
        out = []
        if self._live:
            with self._lock:
                for request_id in request_ids:
                    self._live.pop(request_id, None)
        for request_id in request_ids:
            if self.owns(request_id):
                out += self._abort(request_id)
                self._consumer.pop(request_id, None)
            else:  # not arrived yet, or gone (an unforked choice whose request ended)
                self._consumer.pop(request_id, None)
                self._early_aborts[request_id] = None
                while len(self._early_aborts) > 10_000:
                    self._early_aborts.popitem(last=False)
        return out

    def _op_consumer_expired(self, consumer: str, token: object) -> list[Update]:
        """The grace of a departure ran out: drop what the consumer left, unless it
        rejoined (or left again) meanwhile."""
        with self._lock:
            if self._departed.get(consumer) is not token:
                return []
            del self._departed[consumer]
            for rid in [rid for rid, a in self._live.items() if a.attempt.consumer == consumer]:
                del self._live[rid]
        return self._op_consumer_left(consumer)

    def _op_consumer_left(self, consumer: str) -> list[Update]:
        theirs = [rid for rid, c in self._consumer.items() if c == consumer]
        out = self._op_abort([rid for rid in theirs if self.owns(rid)])
        for rid in theirs:  # finished meanwhile, or never started: nothing left to route
            self._consumer.pop(rid, None)
        with self._lock:
            self._outboxes.pop(consumer, None)
            self._reserved.pop(consumer, None)
            self._waits.pop(consumer, None)
        if theirs:
            log.warning(
                "%s: consumer %r left; dropped its %d requests", self.name, consumer, len(theirs)
            )
        return out

    def take_early_abort(self, request_id: str) -> bool:
        """True (and forgotten) when ``request_id`` was aborted before it arrived."""
        return self._early_aborts.pop(request_id, False) is None

    def owns(self, request_id: str) -> bool:
        """The request is here: a component's, or the engine's own (an unforked choice
        included; on the loop)."""
        return self.engine.owns(request_id) or any(c.owns(request_id) for c in self.components)

    def bind_consumer(self, attempt: Attempt, choices: bool = True) -> None:
        """``attempt``'s updates, and with ``choices`` its choices', go to
        ``attempt.consumer``'s outbox (on the loop)."""
        for rid in (attempt.id, *(attempt.choices if choices else ())):
            self._consumer[rid] = attempt.consumer

    def abort_now(self, request_ids: list[str]) -> list[Update]:
        """Abort these requests now, on the loop (``abort`` posts it)."""
        return self._op_abort(request_ids)

    def count(self, total: str, n: int = 1) -> None:
        """Add ``n`` to the ``total`` in ``stats()`` (0 declares it); on the loop."""
        self._totals[total] = self._totals.get(total, 0) + n

    def _abort(self, request_id: str) -> list[Update]:
        for c in self.components:
            if c.owns(request_id):
                return c.abort(request_id)
        self.engine.abort_request(request_id)
        return []

    def _op_add(self, attempt: Attempt) -> list[Update]:
        if self.take_early_abort(attempt.id):
            return []
        self.bind_consumer(attempt)
        try:
            attempt.queue_in(self.engine)
        except ValueError as e:
            return [Update(attempt.id, error=str(e))]
        self._totals["requests_total"] += 1
        return []

    def _step(self) -> list[Update]:
        try:
            outputs = self.engine.step(self._last_chunk())
        except StepFailed as e:  # the request(s) that made the step fail
            return self.fail(e.request_ids)
        except Exception:  # a bug outside the forward pass: every request fails
            return self.fail(list(self.engine.requests))
        self._totals["steps_total"] += 1
        out: list[Update] = []
        for o in outputs:
            if isinstance(o, Prefilled):
                out += self._prefilled(o)
                continue
            self._totals["tokens_total"] += len(o.new_token_ids)
            # with the end: prompt tokens served from this instance's prefix cache; none
            # when 0 (a decode instance's handed-over request leaves the prefill's figure)
            hit = o.num_cached_tokens if o.finish_reason else 0
            info: dict = {"cached_tokens": hit} if hit else {}
            guessed, accepted, steps = o.guesses  # speculative decoding, at the end
            if steps:
                info["guesses"] = [guessed, accepted, steps]
                self._totals["guessed_tokens_total"] += guessed
                self._totals["accepted_tokens_total"] += accepted
            out.append(Update.of(o.request_id, o, info))
        return out

    def _last_chunk(self) -> LastChunkHook | None:
        """The step's hand-off hook: the one component's with a request handing off."""
        return next((h for c in self.components if (h := c.last_chunk()) is not None), None)

    def _prefilled(self, p: Prefilled) -> list[Update]:
        """A hand-off request left the engine: its owner's to finish."""
        rid = p.request.request_id
        owner = next((c for c in self.components if c.owns(rid)), None)
        if owner is None:
            raise RuntimeError(f"{self.name}: hand-off request {rid!r} has no component")
        return owner.prefilled(p)

    def fail(self, request_ids: list[str]) -> list[Update]:
        """A step raised: these requests fail, the instance serves on. Under tensor
        parallelism the ranks may be out of step (a collective broke, a rank is gone):
        the process ends instead, so that its supervisor restarts the instance whole and
        the router migrates its requests (docs/serving.md, "Supervision and migration")."""
        incident = uuid.uuid4().hex[:12]  # the traceback stays in the log, under this id
        log.error(
            "%s: engine step failed (incident %s)\n%s", self.name, incident, traceback.format_exc()
        )
        if self.ranks:
            log.error("%s: tensor-parallel ranks out of step; ending the process", self.name)
            logging.shutdown()
            os._exit(1)
        message = f"{self.name}: engine step failed (incident {incident}, in the instance's log)"
        for request_id in request_ids:
            self.engine.abort_request(request_id)
        for c in self.components:
            c.fail(request_ids)
        return [Update(request_id, error=message) for request_id in request_ids]

    def _stats(self) -> dict:
        s = self.engine.stats()
        stats = {
            "name": self.name,
            "queued": s.waiting + len(self._inbox),
            "running": s.running,
            "free_blocks": s.free_blocks,
            "total_blocks": s.total_blocks,
            "preemptions_total": s.preemptions,
            # prefix cache: prompt tokens looked up at admission, and those found cached
            "prefix_cache_queries_total": s.queried_tokens,
            "prefix_cache_hits_total": s.hit_tokens,
            "prompt_tokens_computed_total": s.computed_prompt_tokens,
            "prefix_cached_blocks": s.cached_blocks,
            "last_step": list(self._last_step),  # the router's cost estimates (hybrid mode)
            # the ISA of its CPU kernels (engine/native.py), or "torch" without them
            "kernels": self.engine.model.kernels or "torch",
            **self._totals,
        }
        for c in self.components:
            stats.update(c.stats())
        return stats


def _merge(mine: dict[K, V], theirs: dict[K, V], who: str) -> None:
    """``theirs`` into ``mine``: no key may be taken twice (one handler per message type,
    per feed command, per call)."""
    for key, value in theirs.items():
        if key in mine:
            name = key.__name__ if isinstance(key, type) else repr(key)  # a message, or a name
            raise ValueError(f"{who} takes {name}, which another part of the worker takes")
        mine[key] = value
