"""What an instance publishes of its prefix cache (instance/logs.py) and the router's
copy of it (router/cache_index.py), on their own: a real ``BlockManager``'s events, the
snapshot a new, late or restarted-instance consumer gets, and the bound."""

from __future__ import annotations

import random

import pytest

from pdserve.engine.block_hash import block_hashes
from pdserve.engine.block_manager import BlockManager, CacheEvents
from pdserve.instance.logs import CacheLog
from pdserve.instance.messages import CacheCursor, CacheDelta
from pdserve.router.cache_index import CacheIndex

BS = 4


def poll(log: CacheLog, index: CacheIndex) -> CacheDelta:
    delta = log.since(index.cursor)
    index.apply(delta)
    return delta


def run(blocks: BlockManager, owner: str, tokens: list[int]) -> None:
    """A request that computes ``tokens`` (from its cached prefix) and finishes."""
    prefix = blocks.match(tokens)
    blocks.allocate(owner, len(tokens), prefix)
    blocks.commit(owner, tokens, len(tokens))
    blocks.free(owner)


def test_a_consumer_follows_a_block_manager_through_stores_and_evictions():
    blocks = BlockManager(num_blocks=8, block_size=BS, enable_caching=True)
    log, index, late = CacheLog(retain=64), CacheIndex(), CacheIndex()
    assert poll(log, index).snapshot and index.hashes == set()  # new: a snapshot (empty)
    rng = random.Random(0)
    shared = [rng.randrange(100) for _ in range(12)]
    kinds = set()
    for i in range(40):  # shared prefixes and fresh prompts: 8 blocks force evictions
        tokens = (shared if i % 3 else []) + [
            rng.randrange(100) for _ in range(rng.randrange(1, 14))
        ]
        run(blocks, f"r{i}", tokens)
        log.record(blocks.take_events())
        if i % 4 == 0:  # events, or the snapshot when it is shorter
            kinds.add(poll(log, index).snapshot)
            assert index.hashes == set(blocks.cached)
        blocks.check_integrity()
    assert kinds == {False, True}
    poll(log, index)
    assert index.hashes == set(blocks.cached) == log.cached
    poll(log, late)  # joins late: a snapshot of what is cached now
    assert late.hashes == index.hashes and late.cursor == index.cursor
    assert not log.has_news(index.cursor) and log.has_news(CacheCursor())
    assert log.since(None) is None  # a consumer that does not ask gets nothing


def test_the_index_predicts_the_leading_blocks_an_instance_holds():
    blocks = BlockManager(num_blocks=16, block_size=BS, enable_caching=True)
    log, index = CacheLog(retain=64), CacheIndex()
    prompt = list(range(20))
    run(blocks, "a", prompt)  # 5 full blocks registered
    log.record(blocks.take_events())
    poll(log, index)
    assert index.hit_blocks(block_hashes(prompt, BS)) == 5
    other = prompt[:9] + [99] + prompt[10:]  # differs in block 2: blocks 0 and 1 hit
    assert index.hit_blocks(block_hashes(other, BS)) == 2
    assert len(blocks.match(other)) == 2  # the engine agrees
    assert index.hit_blocks(block_hashes([7] + prompt, BS)) == 0


def test_events_of_a_hash_stored_and_evicted_within_one_delta_net_out():
    log, index = CacheLog(retain=64), CacheIndex()
    held = set(range(10, 30))  # enough cached that events are shorter than a snapshot
    log.record(CacheEvents(stored=sorted(held)))
    poll(log, index)
    log.record(CacheEvents(stored=[1, 2]))
    log.record(CacheEvents(stored=[3], removed=[1]))  # 1 evicted
    log.record(CacheEvents(stored=[1], removed=[2, 3]))  # 1 back, 2 and 3 gone
    delta = poll(log, index)
    assert not delta.snapshot and sorted(delta.stored) == [1, 1, 2, 3]
    assert index.hashes == log.cached == held | {1}
    log.record(CacheEvents(stored=[4], removed=[1]))
    assert not poll(log, index).snapshot and index.hashes == held | {4}


def test_a_consumer_behind_the_retained_events_or_of_another_incarnation_gets_a_snapshot():
    log, index = CacheLog(retain=6), CacheIndex()
    poll(log, index)
    for h in range(4):  # 4 events: within the bound, sent as events
        log.record(CacheEvents(stored=[h]))
    assert not poll(log, index).snapshot
    for h in range(4, 12):  # 8 more: the oldest batches are dropped
        log.record(CacheEvents(stored=[h]))
    delta = poll(log, index)
    assert delta.snapshot and sorted(delta.stored) == list(range(12))
    assert index.hashes == set(range(12)) and index.cursor == CacheCursor(log.epoch, log.seq)
    # a delta longer than the snapshot is sent as the snapshot
    log.record(CacheEvents(stored=[100, 101, 102], removed=[100, 101, 102]))
    log.record(CacheEvents(removed=list(range(2, 12))))
    delta = poll(log, index)
    assert delta.snapshot and index.hashes == {0, 1}
    # the instance restarted: a new log (epoch); the old view is replaced, not merged
    restarted = CacheLog(retain=6)
    restarted.record(CacheEvents(stored=[7]))
    assert poll(restarted, index).snapshot and index.hashes == {7}
    with pytest.raises(ValueError, match="epoch"):
        index.apply(CacheDelta(epoch="other", seq=1, stored=[1]))
    with pytest.raises(ValueError, match="retain"):
        CacheLog(retain=0)
