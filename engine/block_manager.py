"""Paged KV cache bookkeeping: which physical blocks each request owns.

Blocks carry reference counts; a block becomes free again when its count drops to
zero. Running out of blocks is reported through ``can_allocate``, never raised from
the scheduler's normal path.

Allocation keeps a request's blocks physically consecutive where it can: a table grows
into the block right after its last one when that is free, and new blocks come from
the first run of free blocks long enough to hold them (lowest ids when none is). The
attention kernels do not care, but the KV transfer does: a run of consecutive blocks
moves as one slice per layer, with no gather at the sender and no scatter at the
receiver (docs/kv_transfer.md). A FIFO free list instead interleaves the blocks that
running requests add one at a time, so that after some churn a new request's blocks
are scattered over the cache.
"""

from __future__ import annotations

FREE, USED = 1, 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref_counts = [0] * num_blocks
        self.free_map = bytearray([FREE]) * num_blocks  # FREE or USED per block id
        self.num_free_blocks = num_blocks
        self.tables: dict[str, list[int]] = {}

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, owner: str) -> list[int]:
        return self.tables.get(owner, [])

    def num_new_blocks(self, owner: str, num_tokens: int) -> int:
        """Blocks ``owner`` lacks to hold ``num_tokens`` tokens in all."""
        return max(0, self.blocks_for(num_tokens) - len(self.block_table(owner)))

    def can_allocate(self, owner: str, num_tokens: int) -> bool:
        return self.num_new_blocks(owner, num_tokens) <= self.num_free_blocks

    def allocate(self, owner: str, num_tokens: int) -> list[int]:
        """Grow ``owner``'s table to hold ``num_tokens`` tokens; returns the new block ids."""
        need = self.num_new_blocks(owner, num_tokens)
        if need > self.num_free_blocks:
            raise RuntimeError(
                f"allocate({owner!r}): {need} blocks needed, {self.num_free_blocks} free"
            )
        table = self.tables.setdefault(owner, [])
        new = self._take(need, table[-1] + 1 if table else None)
        for b in new:
            self.ref_counts[b] = 1
        self.num_free_blocks -= need
        table.extend(new)
        return new

    def _take(self, need: int, after: int | None) -> list[int]:
        """``need`` free block ids, marked used: from ``after`` on while they are free,
        then the first free run that holds the rest, else the lowest free ids."""
        free, out = self.free_map, []
        while need and after is not None and after < self.num_blocks and free[after] == FREE:
            free[after] = USED
            out.append(after)
            after += 1
            need -= 1
        if need:
            start = free.find(bytes([FREE]) * need)
            if start >= 0:
                rest = list(range(start, start + need))
            else:
                rest, start = [], 0
                for _ in range(need):
                    start = free.find(FREE, start)
                    rest.append(start)
                    start += 1
            for b in rest:
                free[b] = USED
            out += rest
        return out

    def free(self, owner: str) -> None:
        """Drop ``owner``'s references; a no-op for an owner without blocks."""
        for b in self.tables.pop(owner, []):
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_map[b] = FREE
                self.num_free_blocks += 1

    def check_integrity(self) -> None:
        """Each block is free (count 0, marked free, counted in ``num_free_blocks``) or
        counted once per table holding it."""
        counts = [0] * self.num_blocks
        for owner, table in self.tables.items():
            if len(set(table)) != len(table):
                raise AssertionError(f"table of {owner!r} repeats a block: {table}")
            for b in table:
                counts[b] += 1
        if counts != self.ref_counts:
            bad = [b for b in range(self.num_blocks) if counts[b] != self.ref_counts[b]]
            raise AssertionError(f"reference counts disagree with the tables for blocks {bad[:10]}")
        free = [b for b in range(self.num_blocks) if self.free_map[b] == FREE]
        if free != [b for b in range(self.num_blocks) if counts[b] == 0]:
            raise AssertionError("the free map differs from the blocks nobody holds")
        if len(free) != self.num_free_blocks:
            raise AssertionError(f"{self.num_free_blocks} blocks counted free, {len(free)} are")
