"""How requests reach engine instances: one ``Placement`` per mode, chosen by the config.

The router core (router/core.py) owns admission and the streams; a placement decides
where a request runs, starts it there, routes the instances' updates back to its
stream, and cleans up on cancel or instance death.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from engine.messages import Attempt, Update
from router.instances import CONSUMER, Instance
from router.policies import RoutingPolicy
from router.stream import Delta, RequestStream


class Placement(ABC):
    """Where requests run in one serving mode.

    Contract (all calls on the router's event loop, none blocks):
    ``can_place(stream)`` says whether ``stream`` could start now; ``place(stream)``
    starts it and returns at once (it may hand the stream back to the router with
    ``router.requeue`` when an instance turns it down); ``cancel(stream)`` takes it out
    of every instance holding it, which frees its KV blocks there; ``on_updates``
    routes one poll's updates to their streams and returns those that ended;
    ``on_dead`` deals with the requests a dead instance held and returns those that
    ended. A stream that ends gets a final ``Delta`` (finish reason or error).
    """

    def __init__(self, router, instances: list[Instance], policy: RoutingPolicy):
        self.router, self.instances, self.policy = router, instances, policy
        self.by_name = {i.name: i for i in instances}

    @property
    def alive(self) -> bool:
        return any(i.dead is None for i in self.instances)

    @abstractmethod
    def can_place(self, stream: RequestStream) -> bool: ...

    @abstractmethod
    def place(self, stream: RequestStream) -> None: ...

    def cancel(self, stream: RequestStream) -> None:
        for inst in self.instances:
            inst.release(stream, abort=True)

    @abstractmethod
    def on_updates(self, inst: Instance, updates: list[Update]) -> list[RequestStream]: ...

    def on_dead(self, inst: Instance) -> list[RequestStream]:
        failed = list(inst.streams.values())
        for stream in failed:
            self.cancel(stream)
            stream.deliver(Delta([], "", "error", inst.dead))
        return failed


class Colocated(Placement):
    """One instance runs the whole request: chunked prefill piggybacked on its decodes."""

    def can_place(self, stream: RequestStream) -> bool:
        return any(i.has_room() for i in self.instances)

    def place(self, stream: RequestStream) -> None:
        candidates = [i.load for i in self.instances if i.has_room()]
        inst = self.by_name[self.policy.choose(len(stream.prompt_ids), candidates).name]
        stream.attempt_id = stream.request_id
        inst.hold(stream)
        stream.sent_to(inst.name)
        inst.handle.add.remote(
            Attempt(stream.attempt_id, tuple(stream.prompt_ids), stream.params, CONSUMER)
        )

    def on_updates(self, inst: Instance, updates: list[Update]) -> list[RequestStream]:
        finished = []
        for u in updates:
            stream = inst.streams.get(u.request_id)
            if stream is None:
                continue  # aborted meanwhile
            stream.deliver(Delta(u.token_ids, u.text, u.finish_reason, u.error))
            if u.final:
                inst.release(stream)
                finished.append(stream)
        return finished
