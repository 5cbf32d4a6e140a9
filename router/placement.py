"""How requests reach engine instances: one ``Placement`` per mode, chosen by the config.

The router core (router/core.py) owns admission and the streams; a placement decides
where a request runs, starts it there, routes the instances' updates back to its
stream, and cleans up on cancel or instance death. It holds no reference to the core:
what it asks of it (migrate, requeue, forget ended streams) comes as ``RouterHooks``,
and what it decides from comes as arguments (the instances, their loads, the request).
"""

from __future__ import annotations

import itertools
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, replace

from pdserve.instance.messages import Attempt, Update, attempt_id
from pdserve.router.instances import Instance
from pdserve.router.policies import InstanceLoad, RoutingPolicy
from pdserve.router.rebuild import context
from pdserve.router.replicas import replica_name
from pdserve.router.stream import Delta, RequestStream


@dataclass(frozen=True)
class RouterHooks:
    """What a placement asks of the router core (router/core.py), each on the router's
    event loop: ``migrate(stream, why)`` continues a request whose current attempt
    ended (False: it ended instead, ``RouterCore.migrate``); ``requeue(stream)`` puts
    it back at the head of the admission queue; ``ended(streams)`` forgets the streams
    that ended outside ``on_updates``/``on_dead`` (an asynchronous reservation's end)."""

    migrate: Callable[[RequestStream, str], bool]
    requeue: Callable[[RequestStream], None]
    ended: Callable[[list[RequestStream]], None]


class Placement(ABC):
    """Where requests run in one serving mode.

    Contract (all calls on the router's event loop, none blocks):
    ``can_place(stream)`` says whether ``stream`` could start now; ``place(stream)``
    starts it and returns at once (it may hand the stream back to the router with
    ``hooks.requeue`` when an instance turns it down); ``cancel(stream)`` takes it out
    of every instance holding it, which frees its KV blocks there; ``on_updates``
    routes one frame's updates to their streams and returns those that ended;
    ``on_dead`` deals with the requests a failed instance held (each migrates, through
    ``hooks.migrate``, or ends) and returns those that ended; it is idempotent (a second
    call for the same incarnation finds nothing held). A stream that ends gets a final
    ``Delta`` (finish reason or error).

    Attempts are handled once: ``AttemptRecord.retire`` (router/attempt_record.py) is
    the one place that decides whether an attempt is its stream's current one, and
    every path that fails, migrates, requeues or drops an attempt acts only when it
    returns True (the first report of a failure
    wins; a second report of the same attempt, say its instance's death and then its
    failed reservation, finds it retired and does nothing). Invariant: an instance holds
    (``Instance.streams``) only a current attempt, or the prefill side of a finished one
    until its handoff is acknowledged.
    """

    def __init__(self, hooks: RouterHooks, instances: list[Instance], policy: RoutingPolicy):
        self.hooks, self.instances, self.policy = hooks, instances, policy
        self.by_name = {i.name: i for i in instances}
        # this router's outbox name on every instance (one per router replica)
        self.consumer = instances[0].consumer if instances else replica_name(0)
        self._incarnation = uuid.uuid4().hex[:8]
        self._serial = itertools.count()

    @property
    def alive(self) -> bool:
        return any(i.dead is None for i in self.instances)

    @property
    def recoverable(self) -> bool:
        return any(i.dead is None or i.restarting for i in self.instances)

    def attempt(self, stream: RequestStream, pair: tuple[str, ...], **fields) -> Attempt:
        """A new try at ``stream`` on ``pair`` (a fresh id, now its current attempt)
        carrying what its client already has; with the attempts of the request's other
        choices while they ride with it (``riding``)."""
        stream.attempt.begin(self._attempt_id(stream), pair)
        riders = self.riding(stream)
        for rider in riders:  # held where the tokens come from: the last of the pair
            rider.attempt.begin(self._attempt_id(rider), pair)
            self.by_name[pair[-1]].hold(rider)
            rider.sent_to(pair[-1])
            rider.waits_for(f"its first token, forked from {stream.attempt.id} on {pair[-1]}")
        return Attempt(
            stream.attempt.id,
            tuple(stream.prompt_ids),
            replace(stream.params, n=1 + len(riders)) if riders else stream.params,
            self.consumer,
            delivered=tuple(stream.token_ids),
            delivered_chars=stream.text_chars,
            context=context(stream),
            choices=tuple(r.attempt.id for r in riders),
            **fields,
        )

    def _attempt_id(self, stream: RequestStream) -> str:
        serial = f"{self._incarnation}{next(self._serial):x}"
        return attempt_id(stream.request_id, stream.attempt.number, serial)

    @staticmethod
    def riding(stream: RequestStream) -> list[RequestStream]:
        """The request's other choices (``RequestStream.riders``) that go with its
        attempt: all of them, at its first try while none has begun one of its own (the
        instance forks each from this attempt, engine/choices.py, seeded seed + i as
        each stream is); else none (each runs alone once it fails or migrates, as any
        request)."""
        riders = stream.riders
        if stream.attempt.number or any(
            r.finished or r.attempt.id or r.attempt.number for r in riders
        ):
            return []
        return riders

    def unseat(self, stream: RequestStream, attempt: Attempt, why: str | None) -> list:
        """``attempt`` of ``stream`` ended before its choices forked, with no instance to
        say so (the instances fail the choices of an attempt they drop): theirs end
        with it, each then migrating (``why``; the streams that ended instead are
        returned) or, with None, riding again at the request's next try (it went back
        to the queue)."""
        ended = []
        for rider in stream.riders:
            rid = rider.attempt.id
            if rid not in attempt.choices or not rider.attempt.retire(rid):
                continue
            for inst in self.instances:
                inst.release(rid, abort=why is not None)
            if why is not None and not self.hooks.migrate(rider, why):
                ended.append(rider)
        return ended

    def loads(self, stream: RequestStream, candidates: list[Instance]) -> list[InstanceLoad]:
        """The candidates' loads for ``policy.choose`` (copies: the instances' own are
        written by router/instances.py alone); for a policy that ``uses_cache``, each
        with ``hit_tokens``: the leading prompt blocks its prefix cache holds (as the
        router's view predicts), capped as the engine caps a hit (the block of the last
        prompt token is always computed: at most ``(prompt - 1) // block_size`` blocks)."""
        if self.policy.uses_cache:
            return [replace(i.load, hit_tokens=self.hit_tokens(i, stream)) for i in candidates]
        return [replace(i.load) for i in candidates]

    def hit_tokens(self, inst: Instance, stream: RequestStream) -> int:
        """The leading prompt tokens ``inst``'s prefix cache holds, as ``loads`` caps them."""
        bs = inst.load.block_size
        hashes = stream.block_hashes(bs)[: (len(stream.prompt_ids) - 1) // bs]
        return inst.cache.hit_blocks(hashes) * bs

    @abstractmethod
    def can_place(self, stream: RequestStream) -> bool: ...

    @abstractmethod
    def place(self, stream: RequestStream) -> None: ...

    def cancel(self, stream: RequestStream) -> None:
        attempt_id = stream.attempt.id
        if stream.attempt.retire(attempt_id):
            for inst in self.instances:
                inst.release(attempt_id, abort=True)

    @abstractmethod
    def on_updates(self, inst: Instance, updates: list[Update]) -> list[RequestStream]: ...

    def on_dead(self, inst: Instance) -> list[RequestStream]:
        why = inst.dead
        assert why is not None  # the core calls on_dead after Instance.fail
        ended = []
        for held, stream in list(inst.streams.items()):
            inst.release(held)
            if not stream.attempt.retire(held):
                continue
            if not self.hooks.migrate(stream, why):
                ended.append(stream)
        return ended


class Colocated(Placement):
    """One instance runs the whole request: chunked prefill piggybacked on its decodes."""

    def can_place(self, stream: RequestStream) -> bool:
        return any(i.has_room() for i in self.instances)

    def place(self, stream: RequestStream) -> None:
        candidates = [i for i in self.instances if i.has_room()]
        fresh = [i for i in candidates if i.name not in stream.attempt.avoid] or candidates
        choice = self.policy.choose(len(stream.prompt_ids), self.loads(stream, fresh))
        inst = self.by_name[choice.name]
        attempt = self.attempt(stream, (inst.name,))
        inst.hold(stream)
        stream.sent_to(inst.name)
        stream.waits_for(f"tokens from {inst.name}")
        inst.add(attempt)

    def on_updates(self, inst: Instance, updates: list[Update]) -> list[RequestStream]:
        finished = []
        for u in updates:
            stream = inst.streams.get(u.request_id)
            if stream is None:
                continue  # aborted meanwhile
            stream.attempt.report(u.info)
            if u.retryable:  # a choice whose request ended before it forked: it runs alone
                inst.release(u.request_id)
                if stream.attempt.retire(u.request_id) and not self.hooks.migrate(
                    stream, u.error or ""
                ):
                    finished.append(stream)
                continue
            if u.invalid:
                stream.deliver(Delta.failed(u.error or "", invalid=True))
            else:
                stream.deliver(
                    Delta(
                        u.token_ids,
                        u.text,
                        u.finish_reason,
                        u.error,
                        logprobs=u.logprobs,
                        prompt_logprobs=u.prompt_logprobs,
                    )
                )
            if u.final:
                inst.release(u.request_id)
                stream.attempt.retire(u.request_id)
                finished.append(stream)
        return finished
