"""The shape of one tensor-parallel rank's paged KV cache, as KV transfer sees it.

The engine's cache (``engine/model_runner.py``) is one tensor per rank,
``[num_layers, 2 (k, v), num_blocks, block_size, num_local_kv_heads, head_dim]``,
token-major inside a block. Rank ``r`` of ``tp_size`` holds the KV heads
``[r*H/tp, (r+1)*H/tp)`` of the model's ``H`` (``engine/parallel.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
# stable small integers for the wire (the int64 header of the gloo/nccl backends)
DTYPE_CODES: dict[str, int] = {"float32": 1, "bfloat16": 2, "float16": 3}
DTYPE_NAMES: dict[int, str] = {v: k for k, v in DTYPE_CODES.items()}


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
            raise KVLayoutError(
                f"KVLayout.dtype={self.dtype!r} is not supported; allowed: {sorted(DTYPES)}"
            )
        if self.num_kv_heads % self.tp_size:
            raise KVLayoutError(
                f"num_kv_heads={self.num_kv_heads} is not divisible by "
                f"tensor_parallel={self.tp_size}: every rank must hold the same number of KV heads"
            )
        if not isinstance(self.tp_rank, int) or not 0 <= self.tp_rank < self.tp_size:
            raise KVLayoutError(
                f"KVLayout.tp_rank={self.tp_rank!r} must be in [0, tp_size={self.tp_size})"
            )

    @property
    def heads_per_rank(self) -> int:
        return self.num_kv_heads // self.tp_size

    def head_range_of(self, rank: int) -> tuple[int, int]:
        """Global KV heads [start, end) held by ``rank`` of this pool."""
        if not 0 <= rank < self.tp_size:
            raise KVLayoutError(f"rank={rank} is outside tensor_parallel={self.tp_size}")
        per = self.heads_per_rank
        return rank * per, (rank + 1) * per

    @property
    def head_range(self) -> tuple[int, int]:
        """Global KV heads [start, end) held by this rank."""
        return self.head_range_of(self.tp_rank)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        return self.torch_dtype.itemsize

    def block_bytes(self, num_heads: int | None = None) -> int:
        """Bytes of one block of K (or of V) for one layer, ``num_heads`` heads (this rank's)."""
        heads = self.heads_per_rank if num_heads is None else num_heads
        return self.block_size * heads * self.head_dim * self.itemsize

    def for_rank(self, rank: int) -> KVLayout:
        return replace(self, tp_rank=rank)

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """The engine's per-rank cache shape for ``num_blocks`` blocks."""
        return (
            self.num_layers,
            2,
            num_blocks,
            self.block_size,
            self.heads_per_rank,
            self.head_dim,
        )

    def check_cache(self, kv_cache: torch.Tensor) -> None:
        """Raise unless ``kv_cache`` is this rank's cache tensor (shape, dtype, contiguity)."""
        if kv_cache.dim() != 6:
            raise KVLayoutError(
                f"kv_cache has shape {tuple(kv_cache.shape)}; expected 6 dims "
                "[layers, 2, blocks, block_size, local kv heads, head_dim]"
            )
        want = self.cache_shape(kv_cache.shape[2])
        if tuple(kv_cache.shape) != want:
            raise KVLayoutError(
                f"kv_cache has shape {tuple(kv_cache.shape)}; this rank's layout "
                f"({self.describe()}) needs {want}"
            )
        if kv_cache.dtype != self.torch_dtype:
            raise KVLayoutError(f"kv_cache dtype is {kv_cache.dtype}; the layout says {self.dtype}")
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
                what = (
                    "the pools must use the same block size (set decode.block_size to match)"
                    if name == "block_size"
                    else "both pools must serve the same model with the same KV dtype"
                )
                raise KVLayoutError(
                    f"KV layouts differ in {name}: this pool has {name}={a!r}, "
                    f"the other has {name}={b!r}; {what}"
                )

    def describe(self) -> str:
        h0, h1 = self.head_range
        return (
            f"{self.num_layers} layers, block_size {self.block_size}, "
            f"{self.num_kv_heads} kv heads x {self.head_dim} ({self.dtype}), "
            f"rank {self.tp_rank}/{self.tp_size} holding heads [{h0}, {h1})"
        )
