"""Routing policies and the admission queue, on their own (no Ray, no gRPC)."""

from __future__ import annotations

import pytest

from pdserve.router.admission import AdmissionQueue
from pdserve.router.policies import (
    POLICIES,
    CacheAware,
    InstanceLoad,
    LeastLoaded,
    RoundRobin,
    make_policy,
)


def loads(*outstanding: int, free: tuple[int, ...] | None = None) -> list[InstanceLoad]:
    free = free or (100,) * len(outstanding)
    return [
        InstanceLoad(name=f"colocated-{i}", index=i, outstanding=o, free_blocks=f)
        for i, (o, f) in enumerate(zip(outstanding, free, strict=True))
    ]


def test_policies_by_name():
    assert set(POLICIES) == {"round_robin", "least_loaded", "cache_aware"}
    assert isinstance(make_policy("round_robin"), RoundRobin)
    with pytest.raises(ValueError, match="round_robin, least_loaded, cache_aware"):
        make_policy("random")


def test_round_robin_cycles_and_skips_instances_without_room():
    policy, three = RoundRobin(), loads(0, 0, 0)
    assert [policy.choose(1, three).index for _ in range(5)] == [0, 1, 2, 0, 1]
    # instance 2 full: the next after 1 is 0
    assert policy.choose(1, [three[0], three[1]]).index == 0
    assert policy.choose(1, three).index == 1


def test_least_loaded_prefers_fewest_unfinished_then_most_free_blocks():
    policy = LeastLoaded()
    assert policy.choose(1, loads(3, 1, 2)).index == 1
    assert policy.choose(1, loads(2, 2, 2, free=(10, 30, 20))).index == 1
    assert policy.choose(1, loads(0, 0)).index == 0  # ties: the first


def cache_loads(*hits: int, used=None, queued=None) -> list[InstanceLoad]:
    """Instances of 100 blocks of 16 tokens: ``hits`` prompt tokens cached on each,
    ``used`` blocks held by running requests, ``queued`` prompt tokens not prefilled."""
    n = len(hits)
    used, queued = used or (0,) * n, queued or (0,) * n
    return [
        InstanceLoad(
            name=f"i{i}",
            index=i,
            total_blocks=100,
            free_blocks=100 - u,
            block_size=16,
            hit_tokens=h,
            prefill_tokens=q,
        )  # fmt: skip
        for i, (h, u, q) in enumerate(zip(hits, used, queued, strict=True))
    ]


def test_cache_aware_cost_is_missed_and_queued_blocks_plus_active_blocks():
    (c,) = cache_loads(32, used=(5,), queued=(20,))
    # prompt 100 tokens: 68 missed -> 5 blocks; 20 queued -> 2 blocks; 5 active
    assert CacheAware.cost(100, c) == 5 + 2 + 5
    assert CacheAware.cost(100, cache_loads(0)[0]) == 7  # nothing cached, idle


def test_cache_aware_prefers_the_instance_holding_the_prefix_net_of_its_load():
    policy = CacheAware()
    assert policy.uses_cache and not LeastLoaded.uses_cache and not RoundRobin.uses_cache
    assert policy.choose(320, cache_loads(0, 256, 128)).index == 1  # the longest hit
    # 16 blocks cached on i1, but 30 blocks busy there: i0 computes 20, i1 4 + 30
    assert policy.choose(320, cache_loads(0, 256, used=(0, 30))).index == 0
    # the prefill pool: a hit behind a long queue loses to an idle instance
    assert policy.choose(320, cache_loads(256, 0, queued=(1600, 0))).index == 1
    # equal costs: fewer unfinished requests, then the lower index
    two = cache_loads(0, 0)
    two[0].outstanding = 1
    assert policy.choose(320, two).index == 1
    assert policy.choose(320, cache_loads(0, 0)).index == 0


def test_admission_queue_is_bounded_fifo():
    q = AdmissionQueue(2)
    assert q.offer("a") and q.offer("b") and not q.offer("c")
    assert len(q) == 2 and q.peek() == "a"
    assert q.remove("a") and not q.remove("a")
    assert q.offer("c") and q.pop() == "b" and q.pop() == "c" and not q
    assert not AdmissionQueue(0).offer("x")
    with pytest.raises(ValueError, match="max_queue"):
        AdmissionQueue(-1)


def unexpected(*args) -> bool:
    """A placement hook these tests never reach (placement alone, nothing fails)."""
    pytest.fail(f"unexpected call to the router core: {args}")


def test_every_attempt_has_an_id_of_its_own_even_when_a_request_id_comes_back():
    """An abort that reaches an instance after its attempt ended is kept there as an
    early abort: it must never match a later attempt, of the same request or of a new
    request that reuses the request id."""
    from pdserve.router.placement import Colocated, RouterHooks
    from pdserve.router.stream import RequestStream

    hooks = RouterHooks(migrate=unexpected, requeue=unexpected, ended=unexpected)
    placement = Colocated(hooks, instances=[], policy=RoundRobin())
    ids = set()
    for _ in range(3):  # a client reusing "r", each request migrated once
        stream = RequestStream("r", [1, 2], None)
        for _ in range(2):
            ids.add(placement.attempt(stream, ("i-0",)).id)
            stream.attempt.failed("gone")
    assert len(ids) == 6 and all(i.startswith("r#") for i in ids)
    again = Colocated(hooks, instances=[], policy=RoundRobin())  # a new router
    assert again.attempt(RequestStream("r", [1, 2], None), ("i-0",)).id not in ids


def test_disaggregated_placement_scores_prefill_and_decode_by_their_cached_prefix():
    """The router's views (no Ray): prefill-1 and decode-0 hold the prompt's first 6
    blocks; cache_aware picks them, least_loaded keeps its own choices."""
    from pdserve.engine.block_hash import block_hashes
    from pdserve.router.disagg import Disaggregated
    from pdserve.router.instances import Instance
    from pdserve.router.placement import RouterHooks
    from pdserve.router.stream import RequestStream

    prompt = list(range(3, 3 + 8 * 16 + 5))
    names = ["prefill-0", "prefill-1", "decode-0", "decode-1"]
    insts = [Instance(n, n.split("-")[0], None, i) for i, n in enumerate(names)]
    for inst in insts:
        inst.ready, inst.capacity = True, 8
        inst.load.total_blocks = inst.load.free_blocks = 100
    held = block_hashes(prompt, 16)[:6]
    insts[1].cache.hashes.update(held)
    insts[2].cache.hashes.update(held)
    insts[3].cache.hashes.update(held[:2])
    insts[3].load.outstanding = -1  # least_loaded would prefer decode-1
    stream = RequestStream("r", prompt, None)
    hooks = RouterHooks(migrate=unexpected, requeue=unexpected, ended=unexpected)
    cache = Disaggregated(hooks, insts, CacheAware())
    assert [c.hit_tokens for c in cache.loads(stream, insts)] == [0, 96, 96, 32]
    assert (cache._prefill_for(stream).name, cache._decode_for(stream).name) == (
        "prefill-1", "decode-0",
    )  # fmt: skip
    insts[1].load.prefill_tokens = 16 * 16  # a long queue outweighs the 6 blocks
    assert cache._prefill_for(stream).name == "prefill-0"
    stream.attempt.avoid.add("prefill-0")  # a failed attempt's instance is avoided
    assert cache._prefill_for(stream).name == "prefill-1"
    plain = Disaggregated(hooks, insts, LeastLoaded())
    fresh = RequestStream("s", prompt, None)
    assert (plain._prefill_for(fresh).name, plain._decode_for(fresh).name) == (
        "prefill-0", "decode-1",
    )  # fmt: skip
