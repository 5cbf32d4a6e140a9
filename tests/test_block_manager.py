"""Block manager bookkeeping."""

from __future__ import annotations

import pytest

from engine.block_manager import BlockManager


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
    bm.free_blocks.append(bm.tables["a"][1])
    with pytest.raises(AssertionError, match="free list"):
        bm.check_integrity()
