"""The shape of one tensor-parallel rank's paged KV cache, and which KV heads each
prefill rank sends each decode rank.

The engine's cache (``engine/model_runner.py``) is one tensor per rank,
``[num_layers, 2 (k, v), num_blocks, block_size, num_local_kv_heads, head_dim]``,
token-major inside a block. Rank ``r`` of ``tp_size`` holds the KV heads
``[r*H/tp, (r+1)*H/tp)`` of the model's ``H`` (``engine/parallel.py``). Prefill rank
``p`` sends decode rank ``d`` the intersection of their head ranges, when not empty;
both sides compute the same routes from the layouts, no mapping travels
(docs/kv_transfer.md, "Head mapping").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


class KVLayoutError(ValueError):
    """A layout that cannot exist, or two pools' layouts that cannot exchange KV."""


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise KVLayoutError(f"KV cache dtype {dtype} is not supported; allowed: {sorted(DTYPES)}")


@dataclass(frozen=True)
class KVLayout:
    """One rank's KV cache shape: model-wide ``num_kv_heads``, this rank's place in its pool."""

    num_layers: int
    block_size: int
    num_kv_heads: int  # the model's total, not this rank's share
    head_dim: int
    dtype: str = "float32"
    tp_size: int = 1
    tp_rank: int = 0

    def __post_init__(self):
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim", "tp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise KVLayoutError(f"KVLayout.{name}={value!r} must be a positive integer")
        if self.dtype not in DTYPES:
            raise KVLayoutError(f"KVLayout.dtype={self.dtype!r}: allowed {sorted(DTYPES)}")
        if self.num_kv_heads % self.tp_size:
            raise KVLayoutError(f"num_kv_heads={self.num_kv_heads} is not divisible by "
                                f"tensor_parallel={self.tp_size}: every rank must hold the "
                                "same number of KV heads")  # fmt: skip
        if not isinstance(self.tp_rank, int) or not 0 <= self.tp_rank < self.tp_size:
            raise KVLayoutError(f"KVLayout.tp_rank={self.tp_rank!r}: allowed [0, {self.tp_size})")

    @property
    def heads_per_rank(self) -> int:
        return self.num_kv_heads // self.tp_size

    @property
    def head_range(self) -> tuple[int, int]:
        """Global KV heads [start, end) held by this rank."""
        per = self.heads_per_rank
        return self.tp_rank * per, (self.tp_rank + 1) * per

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def block_bytes(self, num_heads: int | None = None) -> int:
        """Bytes of one block of K (or of V) for one layer, ``num_heads`` heads (this rank's)."""
        heads = self.heads_per_rank if num_heads is None else num_heads
        return self.block_size * heads * self.head_dim * self.torch_dtype.itemsize

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """The engine's per-rank cache shape for ``num_blocks`` blocks."""
        return (self.num_layers, 2, num_blocks, self.block_size, self.heads_per_rank, self.head_dim)

    def check_cache(self, kv_cache: torch.Tensor) -> None:
        """Raise unless ``kv_cache`` is this rank's cache tensor (shape, dtype, contiguity)."""
        want = self.cache_shape(kv_cache.shape[2]) if kv_cache.dim() == 6 else None
        if tuple(kv_cache.shape) != want or kv_cache.dtype != self.torch_dtype:
            raise KVLayoutError(
                f"kv_cache is {tuple(kv_cache.shape)} {kv_cache.dtype}; this rank's layout "
                f"({self.describe()}) needs [layers, 2, blocks, block_size, local kv heads, "
                f"head_dim] = {want or '6 dims'} of {self.dtype}"
            )
        if not kv_cache.is_contiguous():
            raise KVLayoutError(
                "kv_cache must be contiguous (the engine allocates it in one piece)"
            )

    def check_compatible(self, other: KVLayout) -> None:
        """Raise unless KV computed under ``self`` can be written into a cache laid out as
        ``other`` (the other pool; tensor-parallel degrees may differ)."""
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim", "dtype"):
            a, b = getattr(self, name), getattr(other, name)
            if a != b:
                what = "both pools must serve the same model with the same KV dtype"
                if name == "block_size":
                    what = "the pools must use the same block size (set decode.block_size to match)"
                raise KVLayoutError(f"KV layouts differ in {name}: this pool has {name}={a!r}, "
                                    f"the other has {name}={b!r}; {what}")  # fmt: skip

    def describe(self) -> str:
        return (f"{self.num_layers} layers, block_size {self.block_size}, {self.num_kv_heads} kv "
                f"heads x {self.head_dim} ({self.dtype}), rank {self.tp_rank}/{self.tp_size} "
                f"holding heads {list(self.head_range)}")  # fmt: skip

    def to_proto(self, msg=None):
        """The layout as ``kv_transfer.proto``'s ``KVLayout`` (its only serialized form)."""
        from kv_transfer import kv_transfer_pb2 as pb

        msg = pb.KVLayout() if msg is None else msg
        for name in self.__dataclass_fields__:
            setattr(msg, name, getattr(self, name))
        return msg

    @classmethod
    def from_proto(cls, msg) -> KVLayout:
        return cls(**{name: getattr(msg, name) for name in cls.__dataclass_fields__})


@dataclass(frozen=True)
class HeadRoute:
    """KV heads ``heads`` (global ``[start, end)``) travel from source rank ``src_rank`` to
    destination rank ``dst_rank``; ``src_heads`` / ``dst_heads`` are the same heads as
    local indices into each rank's cache."""

    src_rank: int
    dst_rank: int
    heads: tuple[int, int]
    src_heads: tuple[int, int]
    dst_heads: tuple[int, int]

    @property
    def num_heads(self) -> int:
        return self.heads[1] - self.heads[0]


def all_routes(num_kv_heads: int, src_tp: int, dst_tp: int) -> list[HeadRoute]:
    """Every (source rank, destination rank) route, ordered by source then destination."""
    for side, tp in (("source", src_tp), ("destination", dst_tp)):
        if tp < 1 or num_kv_heads % tp:
            raise KVLayoutError(f"{side} tensor_parallel={tp} does not divide {num_kv_heads} heads")
    sp, dp = num_kv_heads // src_tp, num_kv_heads // dst_tp
    routes = []
    for s in range(src_tp):
        for d in range(dst_tp):
            lo, hi = max(s * sp, d * dp), min((s + 1) * sp, (d + 1) * dp)
            if lo < hi:
                local_s, local_d = (lo - s * sp, hi - s * sp), (lo - d * dp, hi - d * dp)
                routes.append(HeadRoute(s, d, (lo, hi), local_s, local_d))
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


def cache_layout(engine) -> KVLayout:
    """The layout of one rank's cache, from its engine (``engine.LLMEngine`` or a rank's
    ``RankEngine``: the model shard's config, dtype and tensor-parallel place, and the
    block size of its runner's block manager)."""
    m, cfg, size = engine.model, engine.model.cfg, engine.runner.blocks.block_size
    dtype = dtype_name(m.dtype)
    return KVLayout(
        cfg.num_layers, size, cfg.num_kv_heads, cfg.head_dim, dtype, m.tp.size, m.tp.rank
    )
