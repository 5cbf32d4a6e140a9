"""How requests reach engine instances: one ``Placement`` per mode, chosen by the config.

The router core (router/core.py) owns admission and the streams; a placement decides
where a request runs, starts it there, routes the instances' updates back to its
stream, and cleans up on cancel or instance death.
"""

from __future__ import annotations

import itertools
import uuid
from abc import ABC, abstractmethod

from instance.messages import Attempt, Update, attempt_id
from router.instances import Instance
from router.policies import InstanceLoad, RoutingPolicy
from router.rebuild import context
from router.replicas import replica_name
from router.stream import Delta, RequestStream


class Placement(ABC):
    """Where requests run in one serving mode.

    Contract (all calls on the router's event loop, none blocks):
    ``can_place(stream)`` says whether ``stream`` could start now; ``place(stream)``
    starts it and returns at once (it may hand the stream back to the router with
    ``router.requeue`` when an instance turns it down); ``cancel(stream)`` takes it out
    of every instance holding it, which frees its KV blocks there; ``on_updates``
    routes one frame's updates to their streams and returns those that ended;
    ``on_dead`` deals with the requests a failed instance held (each migrates, through
    ``router.migrate``, or ends) and returns those that ended; it is idempotent (a second
    call for the same incarnation finds nothing held). A stream that ends gets a final
    ``Delta`` (finish reason or error).

    Attempts are handled once: ``retire`` is the one place that decides whether an
    attempt is its stream's current one, and every path that fails, migrates, requeues
    or drops an attempt acts only when it returns True (the first report of a failure
    wins; a second report of the same attempt, say its instance's death and then its
    failed reservation, finds it retired and does nothing). Invariant: an instance holds
    (``Instance.streams``) only a current attempt, or the prefill side of a finished one
    until its handoff is acknowledged.
    """

    def __init__(self, router, instances: list[Instance], policy: RoutingPolicy):
        self.router, self.instances, self.policy = router, instances, policy
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

    def attempt(self, stream: RequestStream, **fields) -> Attempt:
        """A new try at ``stream`` (a fresh id) carrying what its client already has."""
        serial = f"{self._incarnation}{next(self._serial):x}"
        stream.attempt_id = attempt_id(stream.request_id, stream.attempt, serial)
        stream.landed = False
        stream.info.pop("cached_tokens", None)  # each attempt reports its own hit
        return Attempt(
            stream.attempt_id,
            tuple(stream.prompt_ids),
            stream.params,
            self.consumer,
            delivered=tuple(stream.token_ids),
            delivered_chars=stream.text_chars,
            context=context(stream),
            **fields,
        )

    @staticmethod
    def retire(stream: RequestStream, attempt_id: str) -> bool:
        """True, once, when ``attempt_id`` is ``stream``'s current attempt: from then on it
        is not (``stream.attempt_id`` is empty until the next ``attempt``), so whichever
        path reports its end first handles it and every later report is a no-op."""
        if not attempt_id or stream.attempt_id != attempt_id:
            return False
        stream.attempt_id = ""
        return True

    def loads(self, stream: RequestStream, candidates: list[Instance]) -> list[InstanceLoad]:
        """The candidates' loads for ``policy.choose``; for a policy that ``uses_cache``,
        each with ``hit_tokens``: the leading prompt blocks its prefix cache holds (as the
        router's view predicts), capped as the engine caps a hit (the block of the last
        prompt token is always computed: at most ``(prompt - 1) // block_size`` blocks)."""
        if self.policy.uses_cache:
            for inst in candidates:
                inst.load.hit_tokens = self.hit_tokens(inst, stream)
        return [i.load for i in candidates]

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
        attempt_id = stream.attempt_id
        if self.retire(stream, attempt_id):
            for inst in self.instances:
                inst.release(attempt_id, abort=True)

    @abstractmethod
    def on_updates(self, inst: Instance, updates: list[Update]) -> list[RequestStream]: ...

    def on_dead(self, inst: Instance) -> list[RequestStream]:
        ended = []
        for held, stream in list(inst.streams.items()):
            inst.release(held)
            if not self.retire(stream, held):
                continue
            if not self.router.migrate(stream, inst.dead):
                ended.append(stream)
        return ended


class Colocated(Placement):
    """One instance runs the whole request: chunked prefill piggybacked on its decodes."""

    def can_place(self, stream: RequestStream) -> bool:
        return any(i.has_room() for i in self.instances)

    def place(self, stream: RequestStream) -> None:
        candidates = [i for i in self.instances if i.has_room()]
        fresh = [i for i in candidates if i.name not in stream.avoid] or candidates
        choice = self.policy.choose(len(stream.prompt_ids), self.loads(stream, fresh))
        inst = self.by_name[choice.name]
        attempt = self.attempt(stream)
        stream.pair = (inst.name,)
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
            stream.info.update(u.info)
            stream.deliver(
                Delta(u.token_ids, u.text, u.finish_reason, u.error, logprobs=u.logprobs)
            )
            if u.final:
                inst.release(u.request_id)
                self.retire(stream, u.request_id)
                finished.append(stream)
        return finished
