"""Prefix reuse in the cluster simulator: requests with their token ids, each instance's
LRU of cached block hashes, and the routing policies' choice of an instance.

What it models, as the engine and router do it (docs/planner.md, "Prefix hits"):
- a block's key is ``engine.block_hash.block_hashes`` of the request's tokens (chained:
  equal keys are equal prefixes), computed once per request;
- an instance caches the full blocks of every prompt it prefilled (at the prompt's
  end) and, where it decoded, of prompt + output (at the finish), in an LRU of
  ``capacity`` = its KV blocks: inserting past it evicts the least recently used key;
- a hit is the run of leading keys present, capped so that one prompt token is still
  computed (``(prompt_len - 1) // block_size`` blocks, as ``BlockManager``); a hit
  refreshes its keys;
- ``least_loaded`` picks the instance with the fewest outstanding requests (most free
  blocks on a tie; a prefill instance: the fewest queued prompt tokens);
  ``cache_aware`` the lowest cost in KV blocks, as ``router.policies.CacheAware``
  (Dynamo's KV router): missed prompt blocks + queued prompt blocks (prefill
  instances) + blocks its running requests hold, ties by outstanding requests;
  ``round_robin`` is simulated as ``least_loaded`` (equal instances, equal requests:
  close).
Simplifications: the LRU holds its capacity whatever the running requests reserve
(the engine evicts only unreferenced blocks, so under pressure it holds fewer), and a
request still reserves all its blocks (shared ones are not counted once).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from pdserve.engine.block_hash import block_hashes

POLICIES = ("least_loaded", "round_robin", "cache_aware")  # round_robin: as least_loaded


@dataclass(frozen=True)
class SimInput:
    """A request with its tokens. ``output_ids`` are what its answer holds (the cache
    keeps them where it decoded); ``follows`` (closed loop, a conversation's next turn):
    the index of the request it follows, and it arrives ``think_s`` after that one
    finishes (``arrival_s`` is then ignored)."""

    arrival_s: float
    prompt_ids: list[int]
    output_ids: list[int]
    follows: int | None = None
    think_s: float = 0.0


@dataclass(frozen=True)
class Keys:
    """A request's block keys: ``prompt`` (its full prompt blocks) and ``whole`` (the
    full blocks of prompt + output)."""

    prompt: tuple[int, ...] = ()
    whole: tuple[int, ...] = ()

    @classmethod
    def of(cls, item: SimInput, block_size: int) -> Keys:
        whole = tuple(block_hashes(item.prompt_ids + item.output_ids, block_size))
        return cls(whole[: len(item.prompt_ids) // block_size], whole)


NO_KEYS = Keys()  # a request given by its lengths: nothing to match or cache


class PrefixLRU:
    """Block keys an instance caches, least recently used first."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.keys: OrderedDict[int, None] = OrderedDict()

    def match(self, keys: tuple[int, ...], limit: int) -> int:
        """Leading ``keys`` cached (at most ``limit``), refreshed as just used."""
        n = 0
        while n < min(limit, len(keys)) and keys[n] in self.keys:
            self.keys.move_to_end(keys[n])
            n += 1
        return n

    def peek(self, keys: tuple[int, ...], limit: int) -> int:
        """``match`` without refreshing: what a router expects."""
        n = 0
        while n < min(limit, len(keys)) and keys[n] in self.keys:
            n += 1
        return n

    def insert(self, keys: tuple[int, ...]) -> None:
        for key in keys:
            self.keys[key] = None
            self.keys.move_to_end(key)
        while len(self.keys) > self.capacity:
            self.keys.popitem(last=False)


def hit_limit(prompt_len: int, block_size: int) -> int:
    """Blocks a prompt may take from the cache: one token is always computed."""
    return max(0, (prompt_len - 1) // block_size)


def expected_hit(inst, r) -> int:
    """Blocks of ``r``'s prompt that ``inst`` holds (0 without a cache)."""
    if inst.cache is None:
        return 0
    return inst.cache.peek(r.keys.prompt, hit_limit(r.prompt_len, inst.pool.block_size))


def cache_aware_cost(inst, r) -> int:
    """``router.policies.CacheAware.cost`` of sending ``r`` to ``inst``, in its blocks."""
    bs = inst.pool.block_size
    miss = -(-(r.prompt_len - expected_hit(inst, r) * bs) // bs)
    queued = -(-inst.queued_tokens // bs) if inst.role == "prefill" else 0
    return miss + queued + inst.total_blocks - inst.free_blocks


def pick(instances: list, r, policy: str, load) -> object:
    """The instance ``policy`` sends ``r`` to; ``load(inst)``: least_loaded's order."""
    if policy == "cache_aware":
        return min(instances, key=lambda i: (cache_aware_cost(i, r), i.outstanding))
    return min(instances, key=load)


def take_hit(inst, r) -> int:
    """Blocks of ``r``'s prompt served from ``inst``'s cache (refreshed)."""
    if inst.cache is None or not r.keys.prompt:
        return 0
    return inst.cache.match(r.keys.prompt, hit_limit(r.prompt_len, inst.pool.block_size))
