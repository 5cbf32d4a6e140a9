"""The router core: the control plane both front ends serve, in the router's own types.

``RouterCore`` owns the admission queue, the requests in flight (their
``RequestStream``s), the placement of the serving mode, request validation, drain and
the load statistics. It reaches the engine instances only through their Ray handles
(router/instances.py) and knows no wire format: the gRPC front end
(router/grpc_api.py) and the HTTP one (router/http_api.py) translate their requests
into ``GenerateRequest`` and its ``Refused`` into their own codes (router/request.py).

Every method runs on the router's event loop and none blocks (tokenization runs on the
intake's threads, router/intake.py); the streams are only touched from there.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import replace

from pdserve.engine.tokenizer import Tokenizer
from pdserve.router.admission import AdmissionQueue, CallLimit, FirstTokens
from pdserve.router.disagg import Disaggregated
from pdserve.router.hybrid import Hybrid
from pdserve.router.incidents import first_line
from pdserve.router.instances import Instance
from pdserve.router.intake import Intake
from pdserve.router.metrics import RouterMetrics
from pdserve.router.placement import Colocated, Placement, RouterHooks
from pdserve.router.policies import make_policy
from pdserve.router.prefill_costs import CostModel
from pdserve.router.rebuild import Rebuild
from pdserve.router.replicas import Peers, Replica, merge_stats
from pdserve.router.request import GenerateRequest, Refusal, Refused
from pdserve.router.request_log import log_request
from pdserve.router.stall import StallWatch
from pdserve.router.stream import Clock, Delta, RequestStream
from pdserve.router.validation import ModelLimits, RequestValidator

CHOICE = "\x1f"  # joins a request id and a choice's index: no client's id holds it
STATS_TIMEOUT_S = 2.0  # an instance that does not answer (stopped, hung) is shown as such


class RouterCore:
    """The control plane.

    Front ends hold a place in ``calls`` for each generate call, await ``open_stream``
    (raises ``Refused``), read the stream until a delta has a finish reason or an error
    (or ``read`` raises ``Refused``: the request's deadline or the queue's timeout
    passed), then ``finish`` it; ``abort`` ends a request by id for its owner;
    ``serving`` is their health. The placement calls ``requeue``, ``after_updates`` and
    ``cancel``. The owner (router/server.py) calls ``bring_up``, ``stop_admitting``,
    ``drain``, ``stop`` and ``stats``.
    """

    def __init__(
        self,
        router_config: dict,
        workers: list[tuple[str, str, object]],
        mode: str = "colocated",
        tokenizer: Tokenizer | None = None,
        supervisor=None,
        *,
        model_name: str,
        slo: dict,
        replica: Replica | None = None,
    ):
        """``workers``: (name, role, Ray actor handle) of every engine instance;
        ``tokenizer``: the model's, None when it has none (token ids only);
        ``supervisor``: the cluster's supervisor (cluster/supervisor.py), told of every
        instance this router sees fail; None: a failed instance stays out;
        ``model_name``: the label ``model_name`` of the request metrics; ``slo``: the
        cluster's ``slo`` section, for SLO attainment; ``replica``: which of the
        cluster's router replicas this is (router/replicas.py): its consumer name on the
        instances' feeds and its share of the bounds."""
        self.tokenizer = tokenizer
        self.metrics = RouterMetrics(model_name, slo)
        self.supervisor = supervisor
        replica = replica or Replica()
        self.replica, self.peers = replica, Peers()
        shared = replica.count > 1
        self.instances = [
            Instance(n, r, h, i, consumer=replica.name, shared=shared)
            for i, (n, r, h) in enumerate(workers)
        ]
        self.by_name = {i.name: i for i in self.instances}
        self.migration_limit: int = router_config["migration_limit"]
        self.stalls = StallWatch(router_config["stall_timeout_s"], self._stalled)
        # the owner's: called when ``serving`` flips (what it returns is not used)
        self.on_health: Callable[[bool], object] = lambda serving: None
        self._serving = False
        share = replica.share
        self.admission: AdmissionQueue[RequestStream] = AdmissionQueue(
            share(router_config["max_queue"])
        )
        self.queue_timeout_s: float = router_config["queue_timeout_s"]
        self.max_expected_ttft_s: float | None = router_config["max_expected_ttft_s"]
        self.first_tokens = FirstTokens()
        self.calls = CallLimit(
            share(router_config["max_concurrent_requests"]),
            share(router_config["max_concurrent_requests_per_key"]),
            lambda key: replica.describe(key, router_config[key]),
            share(router_config["max_concurrent_requests_per_address"]),
        )
        self._queue_bound = replica.describe("max_queue", router_config["max_queue"])
        self.intake = Intake(router_config)
        policy = make_policy(router_config["policy"])
        hooks = RouterHooks(self.migrate, self.requeue, self.after_updates)
        self.placement: Placement
        if mode == "hybrid":
            costs = CostModel(
                router_config["prefill_ms_per_token"], router_config["transfer_mb_per_s"]
            )
            self.placement = Hybrid(
                hooks,
                self.instances,
                policy,
                costs,
                slo["tpot_ms"] / 1000,
                lambda choice: self.metrics.prefill_placed(choice.where, choice.reason),
            )
        else:
            placement = Disaggregated if mode == "disaggregated" else Colocated
            self.placement = placement(hooks, self.instances, policy)
        self.streams: dict[str, RequestStream] = {}  # in flight: queued or sent
        self.validator: RequestValidator | None = None  # set once every instance is ready
        self.draining = False
        # a restarted router's streams (router/rebuild.py), and the instances whose feed
        # has not reported what they hold yet
        self.rebuild = Rebuild(self, router_config["resume_retention_s"])
        self._unreported = {i.name for i in self.instances}

    # ---- state ----

    @property
    def ready(self) -> bool:
        """Every instance has loaded the model (``bring_up`` returned)."""
        return self.validator is not None

    @property
    def alive(self) -> bool:
        """Some instance (a prefill and a decode one when disaggregated, a decode one when
        hybrid) still runs."""
        return self.placement.alive

    @property
    def recoverable(self) -> bool:
        """Alive, or will be again: an instance of each role that is down is restarting."""
        return self.placement.recoverable

    @property
    def serving(self) -> bool:
        """Taking requests: ready, alive and not draining."""
        return self.ready and self.alive and not self.draining

    # ---- lifecycle ----

    async def bring_up(self) -> list[dict]:
        """Wait for every instance's ``ready()`` facts, then take requests: the model's
        limits for validation, one update loop per instance. An instance whose process
        dies meanwhile (one killed while a restarted router brings it up) fails as the end
        of its feed would fail it: the supervisor restarts it and readmits it here. What
        ``ready()`` itself raised (a model that does not load) is raised, and so is a
        death when none is ready or no supervisor restarts instances."""
        from ray.exceptions import RayActorError

        answers = await asyncio.gather(
            *(i.wait_ready() for i in self.instances), return_exceptions=True
        )
        infos = [a for a in answers if isinstance(a, dict)]
        for inst, answer in zip(self.instances, answers, strict=True):
            if not isinstance(answer, BaseException):
                continue
            if not isinstance(answer, RayActorError) or not infos or self.supervisor is None:
                raise answer
            why = f"instance {inst.name} died before it was ready: {first_line(answer)}"
            self._on_dead(inst, why)
        self.validator = RequestValidator(
            self.tokenizer,
            ModelLimits(
                max_context=min(i["max_context"] for i in infos),
                vocab_size=min(i["vocab_size"] for i in infos),
                kv_tokens=min(i["num_blocks"] * i["block_size"] for i in infos),
                max_batch_size=min(i["max_batch_size"] for i in infos),
            ),
        )
        for inst in self.instances:
            if inst.dead is None:  # a dead one's feed starts when it is readmitted
                inst.start_feed(self._on_updates, self._on_dead, self._on_live)
        self.stalls.start(self.streams)
        self._health_changed()
        return infos

    # ---- instances failing and coming back (docs/serving.md, "Supervision and migration")

    def eject(self, name: str, generation: int, why: str, restarting: bool) -> None:
        """The supervisor found generation ``generation`` of ``name`` failed."""
        inst = self.by_name[name]
        if inst.generation != generation:
            return
        if inst.dead is not None:  # this router saw it first
            inst.restarting = restarting
            self._dispatch()
            return
        self._instance_failed(inst, why, restarting)

    def readmit(self, name: str, generation: int, handle, info: dict) -> None:
        """A restarted instance is ready: back in routing. What the old incarnation left
        held here ends as its failure ended the rest (``on_dead`` is idempotent)."""
        inst = self.by_name[name]
        if generation <= inst.generation:
            return
        if inst.dead is None:  # the supervisor replaced it before this router saw it fail
            self._instance_failed(inst, f"instance {name} was replaced", restarting=True)
        elif inst.streams:
            self.after_updates(self.placement.on_dead(inst))
        inst.readmit(handle, generation, info)
        inst.start_feed(self._on_updates, self._on_dead, self._on_live)
        self._health_changed()
        self._dispatch()

    def _on_live(self, inst: Instance, live: list) -> None:
        """The first frame of an instance's feed: what it still holds for this router
        (``LiveAttempt``s: a restarted router's requests, router/rebuild.py)."""
        self._unreported.discard(inst.name)
        self.rebuild.take(inst, live)

    def _on_dead(self, inst: Instance, why: str) -> None:
        """An instance's feed ended: it is gone; the supervisor restarts it."""
        self._unreported.discard(inst.name)
        if self.supervisor is not None:
            self.supervisor.report.remote(inst.name, inst.generation, why)
        self._instance_failed(inst, why, restarting=self.supervisor is not None)

    def _instance_failed(self, inst: Instance, why: str, restarting: bool) -> None:
        inst.fail(why, restarting)
        self.after_updates(self.placement.on_dead(inst))
        self._health_changed()

    def _health_changed(self) -> None:
        if self.serving != self._serving:
            self._serving = self.serving
            self.on_health(self._serving)

    def migrate(self, stream: RequestStream, why: str) -> bool:
        """Continue ``stream`` on another instance (its instance failed): back to the head
        of the queue with what its client already has; False (and the stream ended with
        an error) past ``router.migration_limit`` or when no instance will take it."""
        if stream.finished or self.streams.get(stream.request_id) is not stream:
            return False
        record = stream.attempt
        if record.number >= self.migration_limit or not self.recoverable:
            if record.number:
                why += f" (after {record.number + 1} attempts; earlier: "
                why += "; ".join(record.failures) + ")"
            stream.deliver(Delta([], "", "error", why))
            return False
        record.failed(why)
        self.metrics.migrated()
        stream.waits_for(f"an instance to continue on (attempt {record.number} ended: {why})")
        self.requeue(stream)
        return True

    def stop_admitting(self) -> None:
        """Refuse every new request from now on (UNAVAILABLE: draining)."""
        self.draining = True
        self._health_changed()

    async def drain(self, timeout_s: float) -> int:
        """Refuse new requests and wait for those in flight; returns how many were still
        running at the timeout (they are aborted)."""
        self.stop_admitting()
        deadline = time.monotonic() + timeout_s
        while self.streams and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        left = list(self.streams.values())
        for stream in left:
            self.cancel(stream, "abort")
        return len(left)

    async def stop(self) -> None:
        await self.stalls.stop()
        for inst in self.instances:
            await inst.stop_feed()
        self.intake.close()

    async def stats(self) -> dict:
        """The queue and every instance's load: ``queued``, ``max_queue``, ``in_flight``,
        ``draining``, ``replicas`` (the router replicas counted), ``instances`` (each
        instance's ``stats()`` with ``role``, ``state`` (starting, serving, failed,
        restarting), ``restarts`` (its generation), ``outstanding`` and
        ``requests_total``; ``dead`` (why) instead of the load for one that is down or
        does not answer within ``STATS_TIMEOUT_S``). The router-side counts are summed
        over the replicas that answer (router/replicas.py)."""
        per = await asyncio.gather(
            *(asyncio.wait_for(i.stats(), STATS_TIMEOUT_S) for i in self.instances),
            return_exceptions=True,
        )
        instances = []
        for inst, s in zip(self.instances, per, strict=True):
            s = s if isinstance(s, dict) else {"name": inst.name, "dead": repr(s)}
            s.update(role=inst.role, outstanding=inst.load.outstanding, state=inst.state)
            s["restarts"] = inst.generation
            s["requests_total"] = inst.requests_total
            instances.append(s)
        own = {**self._queue_counts(), "instances": instances}
        return merge_stats(own, await self.peers.counts())

    def _queue_counts(self) -> dict:
        return {
            "queued": len(self.admission),
            "max_queue": self.admission.max_size,
            "in_flight": len(self.streams),
            "draining": self.draining,
        }

    async def exposition(self, accept: str = "") -> tuple[bytes, str]:
        """A metrics scrape (``RouterMetrics.exposition``): this moment's ``stats`` and
        the request metrics summed over the router replicas."""
        stats, peers = await asyncio.gather(self.stats(), self.peers.samples())
        return self.metrics.exposition(stats, accept, peers)

    def own_counts(self) -> dict:
        """This replica's share of ``stats``, for the other replicas to sum: the queue
        counts and, by instance name, (outstanding, requests_total)."""
        instances = {i.name: (i.load.outstanding, i.requests_total) for i in self.instances}
        return {**self._queue_counts(), "instances": instances}

    # ---- requests (called by the front ends) ----

    async def open_stream(
        self,
        request: GenerateRequest,
        arrival: float,
        deadline: float | None = None,
        owner: str = "",
        front: dict | None = None,
    ) -> RequestStream:
        """Validate, tokenize (off the event loop, router/intake.py) and admit
        ``request`` (``arrival``: ``time.monotonic()`` when it reached the front end;
        ``owner``: its API key's, router/auth.py; ``front``: how its front end renders it,
        ``RequestStream.front``): its stream, placed or queued.

        Raises ``Refused``. The caller reads the stream to its end and then calls
        ``finish`` (also when its client goes away). A request of n choices
        (``sampling.n``) is n streams, this one and its ``riders``, choice i seeded
        seed + i; the caller reads and finishes each of them. The router gives up on the request
        (taken out of the router and its instances; ``read`` raises ``Refused``) at
        ``deadline`` (``time.monotonic()``; DEADLINE), and when it is still waiting in
        the admission queue, no token sent, ``router.queue_timeout_s`` after its
        arrival (BUSY)."""
        self._check_open()
        assert self.validator is not None  # _check_open: ready, so bring_up set it
        prompt_ids, params = await self.intake.prepare(request, self.validator)
        self._check_open()  # no await from here to admission: arrival order holds
        request_id = request.request_id or uuid.uuid4().hex
        choices = [
            RequestStream(
                f"{request_id}{CHOICE}{i}" if i else request_id,
                prompt_ids,
                replace(params, n=1, seed=None if params.seed is None else params.seed + i),
                clock=Clock(arrival),
                owner=owner,
                front=front or {},
            )
            for i in range(params.n)
        ]
        for s in choices:
            if s.request_id in self.streams:
                raise Refused(Refusal.EXISTS, f"request_id={s.request_id!r}: already in flight")
        stream = choices[0]
        stream.riders = choices[1:]
        stream.on_first_token = self.first_tokens.note
        for rider in stream.riders:  # they go where it goes (router/placement.py)
            self.streams[rider.request_id] = rider
        try:
            self.admit(stream)
        except Refused:
            for rider in stream.riders:
                del self.streams[rider.request_id]
            raise
        loop = asyncio.get_running_loop()
        waited = time.monotonic() - arrival
        stream.timers.append(
            loop.call_later(self.queue_timeout_s - waited, self._queue_timeout, stream)
        )
        if deadline is not None:
            late = Refused(
                Refusal.DEADLINE,
                f"deadline exceeded: the request had not finished {deadline - arrival:.3g} s "
                "after its arrival",
            )
            for s in choices:
                s.timers.append(
                    loop.call_later(deadline - time.monotonic(), self._give_up, s, late)
                )
        return stream

    def resume(
        self, request_id: str, after: int, owner: str = "", deadline: float | None = None
    ) -> RequestStream:
        """The rebuilt stream of ``request_id`` (owned by ``owner``), for a client that has
        its first ``after`` tokens (``Rebuild.claim``); the caller reads it as
        ``open_stream``'s and then calls ``finish``. Raises ``Refused``: UNAVAILABLE
        while the router is still rebuilding its view (retry), INVALID as ``claim``."""
        if not self.ready or self._unreported:
            raise Refused(
                Refusal.UNAVAILABLE,
                "the router is rebuilding its view of the requests in flight; retry",
            )
        stream = self.rebuild.claim(request_id, after, owner)
        if deadline is not None:
            late = Refused(Refusal.DEADLINE, "deadline exceeded while resuming the request")
            loop = asyncio.get_running_loop()
            stream.timers.append(
                loop.call_later(deadline - time.monotonic(), self._give_up, stream, late)
            )
        return stream

    def _check_open(self) -> None:
        if self.draining:
            raise Refused(Refusal.UNAVAILABLE, "the router is draining")
        if not self.ready:
            raise Refused(Refusal.UNAVAILABLE, "the instances are still loading")
        if not self.recoverable:
            raise Refused(Refusal.UNAVAILABLE, "every engine instance has failed")

    def finish(self, stream: RequestStream) -> None:
        """The stream ended (finished, failed, given up on, or its client went away);
        called once per stream. Its metrics and its log line (router/metrics.py,
        router/request_log.py): a stream that did not end on its own ended ``abort``."""
        for timer in stream.timers:  # they would keep the stream until they fire
            timer.cancel()
        if not stream.finished or stream.request_id in self.streams:
            self.cancel(stream)
        outcome = stream.outcome or "abort"
        if outcome != "refused":  # a refusal is counted where its client is told
            self.metrics.finished(stream, outcome)
        log_request(stream, outcome)

    def _queue_timeout(self, stream: RequestStream) -> None:
        if stream.num_tokens == 0 and stream in self.admission:
            waited = time.monotonic() - stream.clock.arrival
            message = (
                f"waited {waited:.3g} s in the admission queue, past router.queue_timeout_s="
                f"{self.queue_timeout_s:g}; every instance is busy, retry later"
            )
            self._give_up(stream, Refused(Refusal.BUSY, message, reason="queue_timeout"))

    def _give_up(self, stream: RequestStream, refused: Refused) -> None:
        """Take the request out of the router and its instances; its reader gets ``refused``."""
        if self.streams.get(stream.request_id) is stream and not stream.finished:
            stream.deliver(Delta([], "", refused=refused))
            self.cancel(stream)

    def _stalled(self, stream: RequestStream, why: str) -> None:
        """No progress past ``router.stall_timeout_s`` (router/stall.py): the stream ends
        with an error naming what it waited for, and is taken out of its instances."""
        stream.deliver(Delta([], "", "error", why))
        self.cancel(stream)

    def abort(self, request_id: str, owner: str = "") -> bool:
        """End a request in flight with finish reason ``abort``; False when none has that
        id or its owner is another (a caller cannot tell the two apart)."""
        stream = self.streams.get(request_id)
        if stream is None or stream.owner != owner:
            return False
        for rider in stream.riders:  # its other choices: one request
            self.cancel(rider, "abort")
        return self.cancel(stream, "abort")

    async def abort_anywhere(self, request_id: str, owner: str = "") -> bool:
        """``abort`` here, else on the router replica that holds the request."""
        return self.abort(request_id, owner) or await self.peers.abort(request_id, owner)

    # ---- the placement's side ----

    def admit(self, stream: RequestStream) -> None:
        """Place the request now, or queue it. Raises ``Refused`` (BUSY) when the queue is
        full, or when the request would wait for its first token past
        ``router.max_expected_ttft_s``."""
        self._shed_if_late()
        if not self.admission and self.placement.can_place(stream):
            self.streams[stream.request_id] = stream
            self.placement.place(stream)
            return
        if not self.admission.offer(stream):
            raise Refused(
                Refusal.BUSY,
                f"admission queue full: {self.admission.max_size} requests are waiting "
                f"for an instance ({self._queue_bound}); retry later",
                reason="queue_full",
            )
        self.streams[stream.request_id] = stream
        self._dispatch()

    def _shed_if_late(self) -> None:
        """Refuse (BUSY, retry after the expected wait) a request that would get its first
        token past ``router.max_expected_ttft_s``."""
        bound = self.max_expected_ttft_s
        if bound is None:
            return
        waiting = sum(1 for s in self.streams.values() if s.clock.first_token_at is None)
        wait = self.first_tokens.expected_wait_s(waiting)
        if wait is not None and wait > bound:
            raise Refused(
                Refusal.BUSY,
                f"overloaded: {waiting} requests are waiting for their first token; one "
                f"arriving now would wait {wait:.2g} s, past router.max_expected_ttft_s="
                f"{bound:g}; retry later",
                retry_after_s=math.ceil(wait),
                reason="expected_ttft",
            )

    def requeue(self, stream: RequestStream) -> None:
        """An admitted request the placement could not start after all: it goes back to
        the head of the queue (whatever the bound) and waits for room."""
        if stream.finished or self.streams.get(stream.request_id) is not stream:
            return
        self.admission.push_front(stream)
        asyncio.get_running_loop().call_soon(self._dispatch)

    def after_updates(self, ended: list[RequestStream]) -> None:
        """Requests ended (finished or failed): forget them; room for waiting ones."""
        for stream in ended:
            if self.streams.get(stream.request_id) is stream:
                del self.streams[stream.request_id]
        self._dispatch()

    def cancel(self, stream: RequestStream, reason: str | None = None) -> bool:
        """Take a request out of the router and its instances (frees its KV blocks).

        With ``reason``, the stream's client is told it finished that way."""
        if self.streams.pop(stream.request_id, None) is None:
            return False
        if not self.admission.remove(stream):
            self.placement.cancel(stream)
        if reason is not None:
            stream.deliver(Delta([], "", reason))
        stream.finished = True
        self._dispatch()
        return True

    def _dispatch(self) -> None:
        """Start waiting requests, oldest first, while the placement has room."""
        if not self.recoverable:  # nothing will ever take them
            for stream in self.admission.drain():
                self.streams.pop(stream.request_id, None)
                stream.deliver(Delta([], "", "error", "the engine instances have failed"))
            return
        while (head := self.admission.peek()) is not None and self.placement.can_place(head):
            self.placement.place(self.admission.pop())

    def _on_updates(self, inst: Instance, updates: list) -> None:
        self.after_updates(self.placement.on_updates(inst, updates))
