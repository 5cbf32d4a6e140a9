"""Paged KV cache bookkeeping: which physical blocks each request owns, and the prefix
cache (docs/serving.md, "Prefix caching").

Blocks carry reference counts. Every block is in one of three states:

    USED    held by at least one table (count >= 1)
    CACHED  held by none, but registered in the prefix cache: its KV is that of a full
            block whose content hash (engine/block_hash.py) maps to it; a table may
            take it back (``allocate(prefix=...)``), or it is evicted, least recently
            freed first, when EMPTY blocks run out
    EMPTY   held by none, holding nothing anybody can find

``num_free_blocks`` counts CACHED and EMPTY blocks: both can be handed out, so a cache
never makes a request wait. Running out of blocks is reported through ``can_allocate``,
never raised from the scheduler's normal path. A USED block may be registered too, and
shared by several tables (a common prefix); only full blocks are ever registered or
shared, and a table's shared blocks all come first, so no request writes a block that
another one reads (the hits are capped below a sequence's last token, ``match``).

Allocation keeps a request's blocks physically consecutive where it can: a table grows
into the block right after its last one when that is EMPTY, and new blocks come from the
first run of EMPTY blocks long enough to hold them (lowest ids when none is), evicting
CACHED blocks only when EMPTY ones run out. The attention kernels do not care, but the
KV transfer does: a run of consecutive blocks moves as one slice per layer, with no
gather at the sender and no scatter at the receiver (docs/kv_transfer.md).

Sliding windows (``window``: set when every layer of the model attends within the last
W positions, the largest W where they differ; None when any layer is global): a
request whose next token sits at position p reads positions p - W + 1 .. p only, so
after each step ``release_outside`` drops its blocks wholly before p - W + 1, as
``free`` drops a table's blocks, oldest first. Their entries stay in the table as
placeholders (index i is still the block of positions i * block_size ..), counted by
``released``; nothing reads them (the attention backends' contract,
engine/attention/backend.py), nothing here counts them as held, and ``commit`` never
registers one. A released block that was registered becomes CACHED like any freed
one: its KV is a function of the token prefix its hash names (each layer's KV at
position p depends on tokens 0 .. p only, window or not), and ``match`` takes only
runs from a sequence's first block, so a request that reuses it reads exactly what it
would have computed. A request keeps at most ceil((W - 1) / block_size) + 1 blocks
between steps, plus those of the tokens a step adds. A request whose KV arrives from
elsewhere (the decode pool's reservations) starts with its blocks before the window as
placeholders (``allocate(placeholders=...)``, ``window_start``): never held at all.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.engine.block_hash import block_hashes

EMPTY, CACHED, USED = 1, 2, 0
PLACEHOLDER = 0  # the entry of a placeholder reserved as one: any block id would do


def window_start(num_tokens: int, window: int | None, block_size: int) -> int:
    """The index of the first block a token at position ``num_tokens`` reads under a
    sliding ``window`` (W: positions num_tokens - W + 1 .. num_tokens; None: 0)."""
    return 0 if window is None else max(0, num_tokens - window + 1) // block_size


@dataclass
class CacheEvents:
    """What changed in the prefix cache since the last ``take_events``: hashes newly
    registered, and hashes evicted (in that order of events: a hash may be in both)."""

    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = False,
        window: int | None = None,
    ):
        if window is not None and (not isinstance(window, int) or window < 1):
            raise ValueError(f"window={window!r}: allowed values are None or an int >= 1")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_caching, self.window = enable_caching, window
        self.ref_counts = [0] * num_blocks
        self.state = bytearray([EMPTY]) * num_blocks  # EMPTY, CACHED or USED per block id
        self.num_free_blocks = num_blocks
        self.tables: dict[str, list[int]] = {}
        self.released: dict[str, int] = {}  # owner -> leading table entries released
        # the prefix cache: content hash <-> block, and CACHED blocks by when they were freed
        self.cached: dict[int, int] = {}
        self.hash_of: dict[int, int] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.hashes: dict[str, list[int]] = {}  # owner -> hashes of its leading full blocks
        self._events = CacheEvents()

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, owner: str) -> list[int]:
        return self.tables.get(owner, [])

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache (held or not)."""
        return len(self.cached)

    def match(self, token_ids: list[int], max_blocks: int | None = None) -> list[int]:
        """The blocks holding the longest cached run of ``token_ids``' leading full blocks,
        at most ``max_blocks`` and never the block of the last token, so that a sequence
        computes at least that token (its logits) and never writes a shared block:
        ``(len(token_ids) - 1) // block_size`` blocks at most. Takes no reference."""
        if not self.enable_caching:
            return []
        limit = (len(token_ids) - 1) // self.block_size
        if max_blocks is not None:
            limit = min(limit, max_blocks)
        out = []
        for h in block_hashes(token_ids[: limit * self.block_size], self.block_size):
            block = self.cached.get(h)
            if block is None:
                break
            out.append(block)
        return out

    def window_start(self, num_tokens: int) -> int:
        """The table index of the first block that a token at position ``num_tokens``
        reads: its window's first position's block (0 without a window)."""
        return window_start(num_tokens, self.window, self.block_size)

    def num_new_blocks(
        self, owner: str, num_tokens: int, prefix: Sequence[int] = (), placeholders: int = 0
    ) -> int:
        """Free blocks ``owner`` would take to hold ``num_tokens`` tokens in all, starting
        an empty table with ``placeholders`` placeholders and the cached ``prefix`` past
        them (those that are CACHED count: they leave the free pool)."""
        have = len(self.block_table(owner)) or max(len(prefix), placeholders)
        revived = sum(1 for b in prefix[placeholders:] if self.state[b] == CACHED)
        return max(0, self.blocks_for(num_tokens) - have) + revived

    def can_allocate(
        self, owner: str, num_tokens: int, prefix: Sequence[int] = (), placeholders: int = 0
    ) -> bool:
        need = self.num_new_blocks(owner, num_tokens, prefix, placeholders)
        return need <= self.num_free_blocks

    def allocate(
        self, owner: str, num_tokens: int, prefix: Sequence[int] = (), placeholders: int = 0
    ) -> list[int]:
        """Grow ``owner``'s table to hold ``num_tokens`` tokens; returns the new block ids.
        ``prefix`` (from ``match``) starts an empty table with those shared blocks.

        ``placeholders`` (a windowed manager, an empty table, at most the blocks of
        ``num_tokens``): the table starts with that many released entries (``PLACEHOLDER``),
        which hold no block and are never read nor registered, as ``release_outside``
        leaves them; of ``prefix`` only the blocks past them are taken. For a request
        whose KV arrives from elsewhere: ``window_start`` of its next token's position."""
        table = self.tables.get(owner, [])
        if placeholders and (
            self.window is None or table or placeholders > self.blocks_for(num_tokens)
        ):
            raise ValueError(
                f"allocate({owner!r}, {num_tokens}, placeholders={placeholders}): allowed only "
                f"on an empty table ({len(table)} entries) of a windowed manager "
                f"(window={self.window}), at most {self.blocks_for(num_tokens)} placeholders"
            )
        need = self.num_new_blocks(owner, num_tokens, prefix, placeholders)
        if need > self.num_free_blocks:
            raise RuntimeError(
                f"allocate({owner!r}): {need} blocks needed, {self.num_free_blocks} free"
            )
        table = self.tables.setdefault(owner, [])
        if prefix:
            if table:
                raise ValueError(f"allocate({owner!r}, prefix=...): the table is not empty")
            self.hashes[owner] = [self.hash_of[b] for b in prefix]
        if placeholders:
            table.extend([PLACEHOLDER] * placeholders)
            self.released[owner] = placeholders
        for b in prefix[placeholders:]:
            if self.state[b] == CACHED:
                del self.lru[b]
                self.state[b] = USED
                self.num_free_blocks -= 1
            self.ref_counts[b] += 1
        table.extend(prefix[placeholders:])
        count = max(0, self.blocks_for(num_tokens) - len(table))
        new = self._take(count, table[-1] + 1 if table else None)
        for b in new:
            self.ref_counts[b] = 1
        self.num_free_blocks -= count
        table.extend(new)
        return new

    def fork(self, owner: str, child: str, num_tokens: int) -> tuple[int, int] | None:
        """A new table for ``child`` holding ``owner``'s first ``num_tokens`` tokens: it
        shares their full blocks (one more reference each, their registrations too; a
        released placeholder stays one) and takes a block of its own for a partial last
        one, whose KV the caller copies: returns (``owner``'s block, ``child``'s), or None
        when the tokens end on a block boundary. So no block either of them writes next is
        shared. RuntimeError when a partial block is needed and none is free."""
        if child in self.tables:
            raise ValueError(f"fork({owner!r}, {child!r}): {child!r} has a table")
        table, bs = self.tables[owner], self.block_size
        full, partial = divmod(num_tokens, bs)
        if partial and not self.num_free_blocks:
            raise RuntimeError(f"fork({owner!r}, {child!r}): no free block for the last one")
        released = self.released.get(owner, 0)
        shared = table[released:full]
        for b in shared:
            self.ref_counts[b] += 1
        new = table[:released] + shared
        if released:
            self.released[child] = released
        if owner in self.hashes:
            self.hashes[child] = self.hashes[owner][:full]
        pair = None
        if partial:
            [block] = self._take(1, None)
            self.ref_counts[block] = 1
            self.num_free_blocks -= 1
            new.append(block)
            pair = (table[full], block)
        self.tables[child] = new
        return pair

    def commit(self, owner: str, token_ids: list[int], num_tokens: int, partial=0) -> None:
        """``owner``'s first ``num_tokens`` tokens (``token_ids[:num_tokens]``) have their
        KV in its blocks: register its full blocks among them in the prefix cache. Stay
        unregistered: a block whose content another block holds, a released placeholder
        and the entries before ``partial``: blocks whose KV some layer may lack (a
        prefilled request whose transfer sent only the window, to some layers or all)."""
        if not self.enable_caching or owner not in self.tables:
            return
        done = self.hashes.setdefault(owner, [])
        full = min(num_tokens // self.block_size, len(self.tables[owner]))
        if full <= len(done):
            return
        bs = self.block_size
        parent = done[-1] if done else None
        new = block_hashes(token_ids[len(done) * bs : full * bs], bs, parent)
        table, first = self.tables[owner], max(partial, self.released.get(owner, 0))
        for i, h in enumerate(new, start=len(done)):
            block = table[i]
            if i >= first and h not in self.cached and block not in self.hash_of:
                self.cached[h], self.hash_of[block] = block, h
                self._events.stored.append(h)
        done.extend(new)

    def take_events(self) -> CacheEvents:
        """The cache's changes since the last call (for the router's view of it)."""
        events, self._events = self._events, CacheEvents()
        return events

    def _take(self, need: int, after: int | None) -> list[int]:
        """``need`` free block ids, marked used: from ``after`` on while they are EMPTY,
        then the first EMPTY run that holds the rest, else the lowest EMPTY ids; CACHED
        blocks are evicted first (least recently freed first) when EMPTY ones are short."""
        state, out = self.state, []
        while need and after is not None and after < self.num_blocks and state[after] == EMPTY:
            state[after] = USED
            out.append(after)
            after += 1
            need -= 1
        if need:
            empty = self.num_free_blocks - len(self.lru) - len(out)
            for _ in range(need - empty):
                self._evict(next(iter(self.lru)))
            start = state.find(bytes([EMPTY]) * need)
            if start >= 0:
                rest = list(range(start, start + need))
            else:
                rest, start = [], 0
                for _ in range(need):
                    start = state.find(EMPTY, start)
                    rest.append(start)
                    start += 1
            for b in rest:
                state[b] = USED
            out += rest
        return out

    def _evict(self, block: int) -> None:
        """A CACHED block becomes EMPTY: its content can no longer be found."""
        del self.lru[block]
        h = self.hash_of.pop(block)
        del self.cached[h]
        self.state[block] = EMPTY
        self._events.removed.append(h)

    def free(self, owner: str) -> None:
        """Drop ``owner``'s references; a no-op for an owner without blocks. Blocks nobody
        holds become CACHED when registered (the table's last block most recently, so a
        prefix's tail is evicted before its head), else EMPTY."""
        self.hashes.pop(owner, None)
        released = self.released.pop(owner, 0)
        for b in reversed(self.tables.pop(owner, [])[released:]):
            self._drop(b)

    def release_outside(self, owner: str, num_computed: int) -> int:
        """With a window W, ``owner``'s next token sits at position ``num_computed`` and
        reads from position num_computed - W + 1 on: drop its blocks wholly before that
        (oldest first), leaving their table entries as placeholders. Returns how many
        were released now; none without a window or blocks."""
        if self.window is None:  # every step's commit calls this: no lookup without one
            return 0
        table = self.tables.get(owner)
        if not table:
            return 0
        done = self.released.get(owner, 0)
        upto = min(self.window_start(num_computed), len(table))
        for b in table[done:upto]:
            self._drop(b)
        if upto > done:
            self.released[owner] = upto
        return max(0, upto - done)

    def num_held(self, owner: str) -> int:
        """Blocks ``owner``'s table holds (its released placeholders not counted)."""
        return len(self.block_table(owner)) - self.released.get(owner, 0)

    def _drop(self, b: int) -> None:
        """One reference less on block ``b``: unheld, it becomes CACHED when registered
        (most recently freed), else EMPTY."""
        self.ref_counts[b] -= 1
        if self.ref_counts[b] == 0:
            self.num_free_blocks += 1
            if b in self.hash_of:
                self.state[b] = CACHED
                self.lru[b] = None
            else:
                self.state[b] = EMPTY

    def check_integrity(self) -> None:
        """Each block is counted once per table holding it (a table's released placeholders
        hold nothing; only a windowed manager releases); a block nobody holds is CACHED
        exactly when registered (and then in the LRU), else EMPTY; ``num_free_blocks``
        counts both; the cache's two maps agree, and each owner's hashes are those of
        its table's leading blocks still held."""
        counts = [0] * self.num_blocks
        for owner, released in self.released.items():
            table = self.tables.get(owner, [])
            if self.window is None or not 0 < released <= len(table):
                window = self.window
                raise AssertionError(f"{owner!r}: {released} of {len(table)} released, {window=}")
        for owner, table in self.tables.items():
            held = table[self.released.get(owner, 0) :]
            if len(set(held)) != len(held):
                raise AssertionError(f"table of {owner!r} repeats a block: {held}")
            for b in held:
                counts[b] += 1
        if counts != self.ref_counts:
            bad = [b for b in range(self.num_blocks) if counts[b] != self.ref_counts[b]]
            raise AssertionError(f"reference counts disagree with the tables for blocks {bad[:10]}")
        for b in range(self.num_blocks):
            want = USED if counts[b] else CACHED if b in self.hash_of else EMPTY
            if self.state[b] != want:
                raise AssertionError(f"block {b}: state {self.state[b]}, expected {want}")
        if set(self.lru) != {b for b in range(self.num_blocks) if self.state[b] == CACHED}:
            raise AssertionError("the LRU differs from the CACHED blocks")
        free = sum(1 for s in self.state if s != USED)
        if free != self.num_free_blocks:
            raise AssertionError(f"{self.num_free_blocks} blocks counted free, {free} are")
        if {b: h for h, b in self.cached.items()} != self.hash_of:
            raise AssertionError("the hash -> block and block -> hash maps disagree")
        for owner, hashes in self.hashes.items():
            table = self.tables.get(owner, [])
            if len(hashes) > len(table):
                raise AssertionError(f"{owner!r}: {len(hashes)} hashes, {len(table)} blocks")
            pairs = list(zip(hashes, table, strict=False))[self.released.get(owner, 0) :]
            for h, b in pairs:
                if self.hash_of.get(b, h) != h:
                    raise AssertionError(f"{owner!r}: block {b} is registered as other content")
