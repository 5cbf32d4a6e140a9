"""Which units of the cache each prefill rank sends each decode rank (``kv_transfer/
layout.py`` says what a unit is and who sends what; docs/kv_transfer.md, "Head mapping"
and "Latent caches").

A ``HeadRoute`` is one contiguous range of global units from one source rank to one
destination rank, contiguous in both ranks' own caches too (``src_heads``,
``dst_heads``). A pair of ranks may share several routes (a sharded latent's heads and
its RoPE columns); every unit of every destination rank's cache arrives by exactly one
route, except a replicated latent's: it arrives at destination rank 0 only, which
forwards it to the others over its tensor-parallel group (docs/kv_transfer.md, "Latent
caches"). Both sides compute the same routes from the layouts (``routes_from`` on the
sender, ``routes_into`` on the receiver): no mapping travels.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pdserve.kv_transfer.layout import KVLayout, KVLayoutError


@dataclass(frozen=True)
class HeadRoute:
    """Units ``heads`` (global ``[start, end)``: KV heads, or latent row columns) travel
    from source rank ``src_rank`` to destination rank ``dst_rank``; ``src_heads`` /
    ``dst_heads`` are the same units as local indices into each rank's cache."""

    src_rank: int
    dst_rank: int
    heads: tuple[int, int]
    src_heads: tuple[int, int]
    dst_heads: tuple[int, int]

    @property
    def num_heads(self) -> int:
        return self.heads[1] - self.heads[0]


def _check_tp(num_heads: int | None, src_tp: int, dst_tp: int) -> None:
    """Both degrees positive, and dividing ``num_heads`` (None: replicated, any degree)."""
    for side, tp in (("source", src_tp), ("destination", dst_tp)):
        if tp < 1 or (num_heads is not None and num_heads % tp):
            raise KVLayoutError(f"{side} tensor_parallel={tp} does not divide {num_heads} heads")


def _intersections(num_heads: int, src_tp: int, dst_tp: int):
    """``(s, d, lo, hi)``: heads ``[lo, hi)`` held by source rank ``s`` and destination
    rank ``d``, ordered by source then destination (the degrees checked by the caller)."""
    sp, dp = num_heads // src_tp, num_heads // dst_tp
    for s in range(src_tp):
        for d in range(dst_tp):
            lo, hi = max(s * sp, d * dp), min((s + 1) * sp, (d + 1) * dp)
            if lo < hi:
                yield s, d, lo, hi


def all_routes(num_kv_heads: int, src_tp: int, dst_tp: int) -> list[HeadRoute]:
    """Every KV-head route (kind ``kv``), ordered by source then destination."""
    _check_tp(num_kv_heads, src_tp, dst_tp)
    sp, dp = num_kv_heads // src_tp, num_kv_heads // dst_tp
    return [
        HeadRoute(s, d, (lo, hi), (lo - s * sp, hi - s * sp), (lo - d * dp, hi - d * dp))
        for s, d, lo, hi in _intersections(num_kv_heads, src_tp, dst_tp)
    ]


def latent_routes(lay: KVLayout, src_tp: int, dst_tp: int) -> list[HeadRoute]:
    """Every route of a latent layout ``lay`` (any rank's: only its shape counts), ordered
    by source, destination, then units."""
    if lay.replicated:  # the whole row once, prefill rank 0 -> decode rank 0, which
        row = (0, lay.units)  # forwards it to the other decode ranks (decode rank 0)
        _check_tp(None, src_tp, dst_tp)
        return [HeadRoute(0, 0, row, row, row)]
    _check_tp(lay.num_kv_heads, src_tp, dst_tp)
    src = [replace(lay, tp_size=src_tp, tp_rank=s) for s in range(src_tp)]
    dst = [replace(lay, tp_size=dst_tp, tp_rank=d) for d in range(dst_tp)]
    width, rope = lay.head_dim, (lay.num_kv_heads * lay.head_dim, lay.units)
    out = []
    for s, d, lo, hi in _intersections(lay.num_kv_heads, src_tp, dst_tp):
        cols = (lo * width, hi * width)
        out.append(HeadRoute(s, d, cols, src[s].local(cols), dst[d].local(cols)))
        if lo == dst[d].head_range[0]:  # the source holding d's first head: its RoPE key
            out.append(HeadRoute(s, d, rope, src[s].local(rope), dst[d].local(rope)))
    return out


def routes(lay: KVLayout, src_tp: int, dst_tp: int) -> list[HeadRoute]:
    """Every route between pools of ``src_tp`` and ``dst_tp`` ranks of layout ``lay``."""
    if lay.kind == "latent":
        return latent_routes(lay, src_tp, dst_tp)
    return all_routes(lay.num_kv_heads, src_tp, dst_tp)


def routes_from(src: KVLayout, dst_tp: int) -> list[HeadRoute]:
    """The routes leaving source rank ``src.tp_rank`` for a destination pool of ``dst_tp``."""
    return [r for r in routes(src, src.tp_size, dst_tp) if r.src_rank == src.tp_rank]


def routes_into(dst: KVLayout, src_tp: int) -> list[HeadRoute]:
    """The routes arriving at destination rank ``dst.tp_rank`` from a pool of ``src_tp``."""
    return [r for r in routes(dst, src_tp, dst.tp_size) if r.dst_rank == dst.tp_rank]
