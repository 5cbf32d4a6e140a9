"""Routing policies: which instance gets the next request, chosen by name
(docs/serving.md, "Admission and routing" and "Cache-aware routing")."""

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
    block_size: int = 16  # tokens per KV block (the instance's ``ready()``)
    # leading prompt tokens the instance's prefix cache holds, as the router's view of it
    # predicts (router/cache_index.py); filled before ``choose`` only for a policy whose
    # ``uses_cache`` is set, else 0
    hit_tokens: int = 0


class RoutingPolicy(ABC):
    """Picks the instance for one request.

    Contract: ``choose(prompt_len, candidates)`` is called on the router's event loop
    for each request leaving the admission queue, with ``candidates`` a non-empty
    list of the instances that have room now, in ``index`` order. It returns
    one of them, must not block or mutate them, and may keep state of its own
    across calls (a cursor). The router updates the loads; policies only read them.
    ``uses_cache``: the router fills each candidate's ``hit_tokens`` for this request
    before calling ``choose`` (hashing the prompt costs a policy that ignores it).
    """

    name: str = ""
    uses_cache: bool = False

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


class CacheAware(RoutingPolicy):
    """The instance that would finish the new prefill work soonest, net of its load: the
    lowest ``cost`` (Dynamo's KV router: overlap-weighted prefill blocks + active
    blocks), in KV blocks of the candidate:

        cost = OVERLAP_WEIGHT * (miss + queued) + active
        miss   = blocks of the prompt not in its prefix cache (ceil((prompt - hit) / bs))
        queued = blocks of prompt tokens sent to it and not yet handed off (prefill pool)
        active = KV blocks its running requests hold (total - free: cached blocks are free)

    Ties go to fewer unfinished requests, then the lower index. Used for the co-located
    instance, and in disaggregated mode for the decode and the prefill choice."""

    name = "cache_aware"
    uses_cache = True
    OVERLAP_WEIGHT = 1.0  # Dynamo's default overlap_score_weight

    def choose(self, prompt_len: int, candidates: Sequence[InstanceLoad]) -> InstanceLoad:
        return min(candidates, key=lambda c: (self.cost(prompt_len, c), c.outstanding, c.index))

    @classmethod
    def cost(cls, prompt_len: int, c: InstanceLoad) -> float:
        miss = -(-max(0, prompt_len - c.hit_tokens) // c.block_size)
        queued = -(-c.prefill_tokens // c.block_size)
        return cls.OVERLAP_WEIGHT * (miss + queued) + (c.total_blocks - c.free_blocks)


POLICIES: dict[str, type[RoutingPolicy]] = {
    p.name: p for p in (RoundRobin, LeastLoaded, CacheAware)
}


def make_policy(name: str) -> RoutingPolicy:
    if name not in POLICIES:
        raise ValueError(f"router.policy={name!r}: allowed values are {', '.join(POLICIES)}")
    return POLICIES[name]()
