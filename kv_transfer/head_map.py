"""Which KV heads each prefill rank sends to each decode rank (DESIGN.md §4).

Prefill rank ``p`` of ``Tp`` holds global heads ``[p*H/Tp, (p+1)*H/Tp)``; decode rank
``d`` of ``Td`` holds ``[d*H/Td, (d+1)*H/Td)``. Prefill rank ``p`` sends decode rank ``d``
the intersection of the two ranges, when it is not empty. Both sides compute the same
routes from the layouts alone, so no mapping travels on the wire.

    H = 4, Tp = 2, Td = 4          H = 4, Tp = 4, Td = 2
    prefill  [0 1 | 2 3]           prefill  [0 | 1 | 2 | 3]
              |  \\   |  \\                  \\  /     \\  /
    decode   [0 | 1 | 2 | 3]       decode   [0 1  |  2 3]

Pure functions; one concept: head ranges and their intersections.
"""

from __future__ import annotations

from dataclasses import dataclass

from kv_transfer.layout import KVLayout, KVLayoutError


@dataclass(frozen=True)
class HeadRoute:
    """Heads ``heads`` (global) go from ``src_rank`` to ``dst_rank``; ``src_heads`` and
    ``dst_heads`` are the same heads as local indices into each rank's cache."""

    src_rank: int
    dst_rank: int
    heads: tuple[int, int]
    src_heads: tuple[int, int]
    dst_heads: tuple[int, int]

    @property
    def num_heads(self) -> int:
        return self.heads[1] - self.heads[0]


def _per_rank(num_kv_heads: int, tp: int, side: str) -> int:
    if tp < 1 or num_kv_heads % tp:
        raise KVLayoutError(
            f"{side} tensor_parallel={tp} does not divide num_kv_heads={num_kv_heads}"
        )
    return num_kv_heads // tp


def all_routes(num_kv_heads: int, src_tp: int, dst_tp: int) -> list[HeadRoute]:
    """Every (source rank, destination rank) route, ordered by source then destination."""
    sp = _per_rank(num_kv_heads, src_tp, "source")
    dp = _per_rank(num_kv_heads, dst_tp, "destination")
    routes = []
    for s in range(src_tp):
        s0, s1 = s * sp, (s + 1) * sp
        for d in range(dst_tp):
            d0, d1 = d * dp, (d + 1) * dp
            lo, hi = max(s0, d0), min(s1, d1)
            if lo < hi:
                routes.append(HeadRoute(s, d, (lo, hi), (lo - s0, hi - s0), (lo - d0, hi - d0)))
    return routes


def routes_from(src: KVLayout, dst_tp: int) -> list[HeadRoute]:
    """The routes leaving source rank ``src.tp_rank`` for a destination pool of ``dst_tp``."""
    return [
        r for r in all_routes(src.num_kv_heads, src.tp_size, dst_tp) if r.src_rank == src.tp_rank
    ]


def routes_into(dst: KVLayout, src_tp: int) -> list[HeadRoute]:
    """The routes arriving at destination rank ``dst.tp_rank`` from a pool of ``src_tp``."""
    return [
        r for r in all_routes(dst.num_kv_heads, src_tp, dst.tp_size) if r.dst_rank == dst.tp_rank
    ]
