"""Routing policies: which instance gets the next request, chosen by name."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class InstanceLoad:
    """What the router knows of one instance when it places a request."""

    name: str
    index: int = 0  # position in the router's instance list
    outstanding: int = 0  # sent by the router and not finished
    running: int = 0  # in the instance's running batch (last report)
    queued: int = 0  # waiting inside the instance (last report)
    free_blocks: int = 0  # free KV blocks (last report)
    total_blocks: int = 0
    prefill_tokens: int = 0  # prefill instances: prompt tokens sent and not handed off


class RoutingPolicy(ABC):
    """Picks the instance for one request.

    Contract: ``choose(prompt_len, candidates)`` is called on the router's event loop
    for each request leaving the admission queue, with ``candidates`` a non-empty
    list of the instances that have room now, in ``index`` order. It returns
    one of them, must not block or mutate them, and may keep state of its own
    across calls (a cursor). The router updates the loads; policies only read them.
    """

    name: str = ""

    @abstractmethod
    def choose(self, prompt_len: int, candidates: Sequence[InstanceLoad]) -> InstanceLoad: ...


class RoundRobin(RoutingPolicy):
    """Instances in turn, skipping those without room, whatever their load."""

    name = "round_robin"

    def __init__(self):
        self._last = -1

    def choose(self, prompt_len: int, candidates: Sequence[InstanceLoad]) -> InstanceLoad:
        pick = next((c for c in candidates if c.index > self._last), candidates[0])
        self._last = pick.index
        return pick


class LeastLoaded(RoutingPolicy):
    """The instance with the fewest unfinished requests; ties go to more free KV blocks."""

    name = "least_loaded"

    def choose(self, prompt_len: int, candidates: Sequence[InstanceLoad]) -> InstanceLoad:
        return min(candidates, key=lambda c: (c.outstanding, -c.free_blocks, c.index))


POLICIES: dict[str, type[RoutingPolicy]] = {p.name: p for p in (RoundRobin, LeastLoaded)}


def make_policy(name: str) -> RoutingPolicy:
    if name not in POLICIES:
        raise ValueError(f"router.policy={name!r}: allowed values are {', '.join(POLICIES)}")
    return POLICIES[name]()
