"""Block manager bookkeeping."""

from __future__ import annotations

import random

import pytest

from pdserve.engine.block_manager import EMPTY, USED, BlockManager


def test_allocate_grows_tables_and_free_returns_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.can_allocate("a", 9)
    assert len(bm.allocate("a", 9)) == 3
    assert bm.allocate("a", 12) == []
    assert len(bm.allocate("a", 13)) == 1
    bm.allocate("b", 4)
    assert bm.num_free_blocks == 3
    assert not bm.can_allocate("c", 13)
    bm.check_integrity()
    bm.free("a")
    bm.free("a")
    assert bm.num_free_blocks == 7
    bm.free("b")
    bm.check_integrity()
    assert bm.num_free_blocks == 8


def test_allocate_without_room_raises():
    bm = BlockManager(num_blocks=2, block_size=4)
    with pytest.raises(RuntimeError, match="3 blocks needed, 2 free"):
        bm.allocate("a", 12)
    bm.check_integrity()


def test_integrity_catches_corruption():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate("a", 8)
    bm.ref_counts[bm.tables["a"][0]] = 2
    with pytest.raises(AssertionError, match="reference counts"):
        bm.check_integrity()
    bm.ref_counts[bm.tables["a"][0]] = 1
    bm.state[bm.tables["a"][1]] = EMPTY
    with pytest.raises(AssertionError, match="state"):
        bm.check_integrity()
    bm.state[bm.tables["a"][1]] = USED
    bm.num_free_blocks += 1
    with pytest.raises(AssertionError, match="3 blocks counted free, 2 are"):
        bm.check_integrity()


def _runs(ids: list[int]) -> int:
    return 1 + sum(1 for a, b in zip(ids, ids[1:], strict=False) if b != a + 1)


def test_tables_stay_physically_consecutive():
    bm = BlockManager(num_blocks=16, block_size=4)
    assert bm.allocate("a", 8) == [0, 1]
    assert bm.allocate("b", 8) == [2, 3]
    bm.free("a")
    assert bm.allocate("c", 12) == [4, 5, 6]  # the first free run that holds it
    assert bm.allocate("d", 4) == [0]
    assert bm.allocate("d", 8) == [1]  # grows into the block after its last
    assert bm.allocate("b", 12) == [7]  # 4 is taken: the first free run of one
    assert bm.allocate("e", 4 * 8) == [8, 9, 10, 11, 12, 13, 14, 15]
    bm.check_integrity()


def test_no_run_long_enough_takes_the_lowest_free_ids():
    bm = BlockManager(num_blocks=8, block_size=1)
    for i in range(8):
        bm.allocate(f"r{i}", 1)
    for i in (1, 3, 4, 6):
        bm.free(f"r{i}")
    assert bm.allocate("x", 3) == [1, 3, 4]  # no free run of three: the lowest ids
    bm.free("x")
    assert bm.allocate("y", 4) == [1, 3, 4, 6]
    bm.check_integrity()
    assert bm.num_free_blocks == 0


def test_churn_keeps_new_tables_in_one_run_and_the_books_right():
    """Requests arrive with prompts, grow a block at a time while they decode (their
    growth interleaves) and leave: new requests still get one run of blocks."""
    rng = random.Random(0)
    bm = BlockManager(num_blocks=256, block_size=16)
    running: dict[str, list[int]] = {}  # id -> [tokens, tokens left to decode]
    runs = []
    for step in range(6000):
        if rng.random() < 0.03:
            rid, prompt = f"r{step}", rng.randint(100, 700)
            if bm.can_allocate(rid, prompt):
                runs.append(_runs(bm.allocate(rid, prompt)))
                running[rid] = [prompt, rng.randint(16, 80)]
        for rid, state in list(running.items()):
            if state[1] == 0 or not bm.can_allocate(rid, state[0] + 1):
                bm.free(rid)
                del running[rid]
                continue
            bm.allocate(rid, state[0] + 1)
            state[0], state[1] = state[0] + 1, state[1] - 1
        if step % 500 == 0:
            bm.check_integrity()
    assert len(runs) > 100 and sum(r == 1 for r in runs) / len(runs) > 0.9
    for rid in list(running):
        bm.free(rid)
    bm.check_integrity()
    assert bm.num_free_blocks == 256


def test_prefix_cache_shares_full_blocks_and_evicts_least_recently_freed():
    bm = BlockManager(num_blocks=8, block_size=4, enable_caching=True)
    a = list(range(10))  # two full blocks and a partial one
    bm.allocate("a", len(a))
    bm.commit("a", a, len(a))
    assert bm.num_cached_blocks == 2 and bm.take_events().stored
    hit = bm.match(a + [99])
    assert hit == bm.tables["a"][:2]
    bm.allocate("b", 11, hit)  # shares two blocks, takes one more
    assert bm.ref_counts[hit[0]] == 2 and bm.num_free_blocks == 8 - 4
    bm.check_integrity()
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == 8 and bm.num_cached_blocks == 2
    bm.check_integrity()
    # the whole sequence cached: the last token's block is never a hit
    assert len(bm.match(a[:8])) == 1
    bm.allocate("c", 8 * 4)  # every block: the cached ones are evicted
    assert bm.num_cached_blocks == 0 and len(bm.take_events().removed) == 2
    bm.check_integrity()
    bm.free("c")
    assert bm.match(a) == []


def test_caching_off_matches_nothing():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate("a", 8)
    bm.commit("a", list(range(8)), 8)
    bm.free("a")
    assert bm.match(list(range(9))) == [] and bm.num_cached_blocks == 0
    bm.check_integrity()


@pytest.mark.parametrize("caching", [False, True])
def test_a_fork_shares_full_blocks_and_copies_the_partial_one(caching):
    """``fork`` (engine/choices.py): the child holds the parent's full blocks (and their
    registrations) and a block of its own for a partial last one; either frees first."""
    bm = BlockManager(num_blocks=8, block_size=4, enable_caching=caching)
    tokens = list(range(10))
    bm.allocate("a", 10)
    bm.commit("a", tokens, 10)
    table = bm.block_table("a")
    src, dst = bm.fork("a", "b", 10)
    assert src == table[2] and bm.block_table("b") == [*table[:2], dst] and dst not in table
    assert bm.fork("a", "c", 8) is None and bm.block_table("c") == table[:2]
    assert bm.ref_counts[table[0]] == 3 and bm.num_free_blocks == 4
    bm.check_integrity()
    with pytest.raises(ValueError, match="'b' has a table"):
        bm.fork("a", "b", 10)
    bm.free("a")
    bm.check_integrity()
    assert bm.ref_counts[table[0]] == 2
    for owner in ("b", "c"):
        bm.free(owner)
        bm.check_integrity()
    assert bm.num_free_blocks == 8


def test_a_fork_without_a_free_block_for_the_partial_one_raises():
    bm = BlockManager(num_blocks=3, block_size=4)
    bm.allocate("a", 10)
    with pytest.raises(RuntimeError, match="no free block for the last one"):
        bm.fork("a", "b", 10)
    assert "b" not in bm.tables and bm.fork("a", "b", 8) is None
    bm.check_integrity()


def test_a_fork_of_a_windowed_table_keeps_its_placeholders():
    bm = BlockManager(num_blocks=8, block_size=4, window=6)
    bm.allocate("a", 14)
    assert bm.release_outside("a", 14) == 2
    src, dst = bm.fork("a", "b", 14)
    assert bm.block_table("b")[:3] == bm.block_table("a")[:3] and bm.released["b"] == 2
    assert src == bm.block_table("a")[3]
    bm.check_integrity()
    bm.free("a")
    bm.free("b")
    bm.check_integrity()
    assert bm.num_free_blocks == 8
