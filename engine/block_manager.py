"""Paged KV cache bookkeeping: which physical blocks each request owns.

Blocks carry reference counts; a block returns to the free list when its count
drops to zero. Running out of blocks is reported through
``can_allocate``, never raised from the scheduler's normal path.
"""

from __future__ import annotations

from collections import deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref_counts = [0] * num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, owner: str) -> list[int]:
        return self.tables.get(owner, [])

    def num_new_blocks(self, owner: str, num_tokens: int) -> int:
        """Blocks ``owner`` lacks to hold ``num_tokens`` tokens in all."""
        return max(0, self.blocks_for(num_tokens) - len(self.block_table(owner)))

    def can_allocate(self, owner: str, num_tokens: int) -> bool:
        return self.num_new_blocks(owner, num_tokens) <= len(self.free_blocks)

    def allocate(self, owner: str, num_tokens: int) -> list[int]:
        """Grow ``owner``'s table to hold ``num_tokens`` tokens; returns the new block ids."""
        need = self.num_new_blocks(owner, num_tokens)
        if need > len(self.free_blocks):
            raise RuntimeError(
                f"allocate({owner!r}): {need} blocks needed, {self.num_free_blocks} free"
            )
        new = [self.free_blocks.popleft() for _ in range(need)]
        for b in new:
            self.ref_counts[b] = 1
        self.tables.setdefault(owner, []).extend(new)
        return new

    def free(self, owner: str) -> None:
        """Drop ``owner``'s references; a no-op for an owner without blocks."""
        for b in self.tables.pop(owner, []):
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_blocks.append(b)

    def check_integrity(self) -> None:
        """Each block is free (count 0, listed once) or counted once per table holding it."""
        counts = [0] * self.num_blocks
        for owner, table in self.tables.items():
            if len(set(table)) != len(table):
                raise AssertionError(f"table of {owner!r} repeats a block: {table}")
            for b in table:
                counts[b] += 1
        if counts != self.ref_counts:
            bad = [b for b in range(self.num_blocks) if counts[b] != self.ref_counts[b]]
            raise AssertionError(f"reference counts disagree with the tables for blocks {bad[:10]}")
        free = list(self.free_blocks)
        if len(set(free)) != len(free):
            raise AssertionError("a block is on the free list twice")
        if set(free) != {b for b in range(self.num_blocks) if counts[b] == 0}:
            raise AssertionError("the free list differs from the blocks nobody holds")
