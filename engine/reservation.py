"""Remote KV: a request whose prompt KV another instance computes and sends into this
engine's cache (the decode pool's every request; docs/kv_transfer.md has the handoff).

It is a request state in the scheduler (engine/scheduler.py): ``admit_remote`` takes
the request as WAITING_FOR_KV, holding the blocks its prompt (and a resumed request's
delivered tokens) needs, counted with the running and waiting requests; ``land`` moves
it to the running batch once its KV is in those blocks; ``remove`` (release, abort)
frees them like any request's. What the transfer needs of it is its ``Reservation``.

Its table, in order: ``outside_blocks`` placeholders (a model whose every layer slides:
the blocks wholly before the window of its next token, neither held nor sent), then
``cached_blocks`` leading full blocks this instance's prefix cache already holds (shared,
not sent), then ``block_ids``, the new blocks the transfer writes. Each layer ``l``
receives ``block_ids[layer_skip[l]:]`` (a sliding layer of a model with global layers
too: the blocks before its window are not sent; ``()`` when no layer skips one).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.engine.block_manager import window_start


@dataclass(frozen=True)
class Reservation:
    """The blocks held for one attempt whose KV arrives from elsewhere (module docstring).
    Invariant: ``block_ids`` is never empty (at least the block of the last token is
    sent) and holds no block another table shares."""

    attempt_id: str
    block_ids: tuple[int, ...]
    cached_blocks: int = 0
    outside_blocks: int = 0
    layer_skip: tuple[int, ...] = ()

    @property
    def partial_blocks(self) -> int:
        """Leading table entries some layer did not receive (placeholders, shared blocks
        and the blocks a sliding layer skipped): never registered in the prefix cache
        when the request lands (``BlockManager.commit``'s ``partial``)."""
        return self.outside_blocks + self.cached_blocks + max(self.layer_skip, default=0)


@dataclass(frozen=True)
class NoRoom:
    """``admit_remote`` refused: the batch or the cache has no room for the attempt now
    (nothing is held; another instance, or a later try, may take it)."""

    attempt_id: str
    reason: str


def layer_skip(
    windows: Sequence[int | None], n: int, block_size: int, sent_from: int
) -> tuple[int, ...]:
    """``Reservation.layer_skip``: per layer (``windows``: each one's window, None for a
    global layer), the leading blocks of the sent list (the table from ``sent_from`` on)
    it never reads. The next token sits at position ``n``; a layer of window W reads
    n - W + 1 .. n, so the blocks wholly before that one's are skipped (as
    ``BlockManager.window_start``; capped: the last block is always sent). Empty when
    no layer skips a block."""
    last = -(-n // block_size) - 1
    skip = [max(0, min(window_start(n, w, block_size), last) - sent_from) for w in windows]
    return tuple(skip) if any(skip) else ()
