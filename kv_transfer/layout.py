"""The shape of one tensor-parallel rank's paged cache, and which part of it each prefill
rank sends each decode rank.

Two kinds of cache (``KVLayout.kind``), both token-major inside a block:

* ``kv``: ``[num_layers, 2 (k, v), num_blocks, block_size, H/tp, head_dim]`` per rank
  (``engine/model_runner.py``). Rank ``r`` of ``tp`` holds the KV heads
  ``[r*H/tp, (r+1)*H/tp)`` of the model's ``H``; prefill rank ``p`` sends decode rank
  ``d`` the intersection of their head ranges, when not empty.
* ``latent`` (MLA, GLA, GTA): one allocation ``[num_layers, num_blocks, block_size,
  Hc_local*Dc + Dr]`` per rank; a token's row is the rank's ``Hc_local`` latent (or
  tied) heads of width ``Dc`` (``num_kv_heads`` = the model's ``Hc``, ``head_dim`` =
  ``Dc``), then the decoupled RoPE key of width ``Dr`` (``rope_dim``) that every query
  head shares. Sharded (GLA, GTA): rank ``r`` holds latent heads ``[r*Hc/tp,
  (r+1)*Hc/tp)`` and its own copy of the RoPE key. Replicated (MLA, ``replicated``):
  every rank holds the whole row, ``Hc_local = Hc``.

The transport sees both kinds through one *unit view* (``unit_view``): ``[num_layers,
parts, num_blocks, block_size, units, unit_dim]``, ``parts`` = 2 (K, V) and units = KV
heads of ``head_dim`` for ``kv``; ``parts`` = 1 and units = single columns of the row
(``unit_dim`` = 1) for ``latent``. A route and a segment name a range of *global* units:
KV heads, or columns of the model-wide latent row ``[Hc*Dc latent columns | Dr RoPE
columns]`` (``local`` maps them into a rank's own row).

Who sends what (``routes``), each decode rank's share arriving exactly once:

* ``kv``: every non-empty head intersection.
* ``latent``, sharded: every non-empty intersection of latent-head ranges (as columns),
  and the RoPE columns from the one prefill rank whose latent range holds the decode
  rank's first latent head.
* ``latent``, replicated: decode rank 0 gets the whole row from prefill rank 0 only
  (the other ranks of both pools send and receive nothing over the wire). One copy per
  decode *instance* travels: decode rank 0 forwards it to its other ranks over the
  instance's tensor-parallel group before the request runs (the decode
  worker's receiving component, docs/kv_transfer.md, "Latent caches").

Bytes a request moves for ``n`` blocks sent (``transfer_bytes``), ``e`` bytes an element,
``L`` layers, ``bs`` block size, ``Td`` the decode tensor-parallel degree:
``kv``: ``2 L n bs H head_dim e``; latent sharded: ``L n bs (Hc Dc + Td Dr) e``; latent
replicated: ``L n bs (Hc Dc + Dr) e``, whatever ``Td``. When layer ``l`` skips ``s_l``
of the ``n`` blocks (``KVDestination.layer_skip``), ``L n`` becomes ``L n - sum(s_l)``.
Both sides compute the same routes from the layouts, no mapping travels
(docs/kv_transfer.md, "Head mapping").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# the KV dtypes by torch's names, with their bytes per element; torch loads only where a
# layout meets a tensor, so a process that only plans transfers does not import it
DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2}
KINDS = ("kv", "latent")


class KVLayoutError(ValueError):
    """A layout that cannot exist, or two pools' layouts that cannot exchange KV."""


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name in DTYPES:
        return name
    raise KVLayoutError(f"KV cache dtype {dtype} is not supported; allowed: {sorted(DTYPES)}")


@dataclass(frozen=True)
class KVLayout:
    """One rank's cache shape and its place in its pool. ``num_kv_heads``: the model's
    cached heads (KV heads; latent or tied heads ``Hc`` for ``latent``), ``head_dim``
    their width (``Dc`` for ``latent``), ``rope_dim`` the RoPE key's width ``Dr``
    (``latent`` only, else 0), ``replicated``: every rank holds every latent head (MLA)."""

    num_layers: int
    block_size: int
    num_kv_heads: int  # the model's total, not this rank's share
    head_dim: int
    dtype: str = "float32"
    tp_size: int = 1
    tp_rank: int = 0
    kind: str = "kv"
    rope_dim: int = 0
    replicated: bool = False

    def __post_init__(self):
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim", "tp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise KVLayoutError(f"KVLayout.{name}={value!r} must be a positive integer")
        if self.dtype not in DTYPES:
            raise KVLayoutError(f"KVLayout.dtype={self.dtype!r}: allowed {sorted(DTYPES)}")
        if self.kind not in KINDS:
            raise KVLayoutError(f"KVLayout.kind={self.kind!r}: allowed {list(KINDS)}")
        latent = self.kind == "latent"
        rope = self.rope_dim
        if not isinstance(rope, int) or isinstance(rope, bool) or (rope < 1 if latent else rope):
            raise KVLayoutError(
                f"KVLayout.rope_dim={rope!r}: allowed "
                f"{'a positive integer' if latent else '0'} for kind "
                f"{self.kind!r}"
            )
        if not isinstance(self.replicated, bool) or (self.replicated and not latent):
            raise KVLayoutError(
                f"KVLayout.replicated={self.replicated!r}: allowed True or "
                "False for kind 'latent', False for 'kv'"
            )
        if self.num_kv_heads % self.tp_size and not self.replicated:
            what = "latent heads (or set replicated)" if latent else "KV heads"
            raise KVLayoutError(
                f"num_kv_heads={self.num_kv_heads} is not divisible by "
                f"tensor_parallel={self.tp_size}: every rank must hold the "
                f"same number of {what}"
            )
        if not isinstance(self.tp_rank, int) or not 0 <= self.tp_rank < self.tp_size:
            raise KVLayoutError(f"KVLayout.tp_rank={self.tp_rank!r}: allowed [0, {self.tp_size})")

    @property
    def heads_per_rank(self) -> int:
        return self.num_kv_heads if self.replicated else self.num_kv_heads // self.tp_size

    @property
    def head_range(self) -> tuple[int, int]:
        """Global KV (or latent) heads [start, end) held by this rank."""
        if self.replicated:
            return 0, self.num_kv_heads
        per = self.heads_per_rank
        return self.tp_rank * per, (self.tp_rank + 1) * per

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)

    # -- the unit view -----------------------------------------------------------------
    @property
    def parts(self) -> int:
        """Tensors per layer and block: K and V (``kv``), the row (``latent``)."""
        return 2 if self.kind == "kv" else 1

    @property
    def unit_dim(self) -> int:
        return self.head_dim if self.kind == "kv" else 1

    @property
    def units(self) -> int:
        """Global units: KV heads, or columns of the model-wide latent row."""
        if self.kind == "kv":
            return self.num_kv_heads
        return self.num_kv_heads * self.head_dim + self.rope_dim

    @property
    def units_per_rank(self) -> int:
        """Units in this rank's cache: its KV heads, or its row's width."""
        if self.kind == "kv":
            return self.heads_per_rank
        return self.heads_per_rank * self.head_dim + self.rope_dim

    def local(self, units: tuple[int, int]) -> tuple[int, int]:
        """Global units ``[u0, u1)`` (inside this rank's share, and all latent or all
        RoPE) as indices into this rank's own units."""
        if self.kind == "kv":
            return units[0] - self.head_range[0], units[1] - self.head_range[0]
        latent = self.num_kv_heads * self.head_dim
        shift = self.head_range[0] * self.head_dim
        if units[0] >= latent:  # the RoPE columns: after this rank's latent heads
            shift = latent - self.heads_per_rank * self.head_dim
        return units[0] - shift, units[1] - shift

    def unit_view(self, cache: torch.Tensor) -> torch.Tensor:
        """The rank's cache (``cache_shape``) as ``[layers, parts, blocks, block_size,
        units, unit_dim]``: a view, no copy."""
        return cache if self.kind == "kv" else cache.unsqueeze(1).unsqueeze(-1)

    def block_bytes(self, num_units: int | None = None) -> int:
        """Bytes of one part (K, V or the row) of one block of one layer, ``num_units``
        units (this rank's)."""
        units = self.units_per_rank if num_units is None else num_units
        return self.block_size * units * self.unit_dim * DTYPES[self.dtype]

    def transfer_bytes(self, num_blocks: int, dst_tp: int, layer_skip=()) -> int:
        """What a request of ``num_blocks`` sent blocks moves in all, from every prefill
        rank to a decode pool of ``dst_tp`` ranks (the module docstring's formula), when
        layer ``l`` skips the first ``layer_skip[l]`` of them (``KVDestination``)."""
        per_token = self.num_kv_heads * self.head_dim  # kv: K's (and V's) elements
        if self.kind == "kv":
            per_token *= 2
        elif self.replicated:  # once: decode rank 0 forwards it to the others
            per_token += self.rope_dim
        else:
            per_token += dst_tp * self.rope_dim
        tokens = (self.num_layers * num_blocks - sum(layer_skip)) * self.block_size
        return tokens * per_token * DTYPES[self.dtype]

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """The engine's per-rank cache shape for ``num_blocks`` blocks."""
        if self.kind == "latent":
            return (self.num_layers, num_blocks, self.block_size, self.units_per_rank)
        return (self.num_layers, 2, num_blocks, self.block_size, self.heads_per_rank, self.head_dim)

    def check_cache(self, cache: torch.Tensor) -> None:
        """Raise unless ``cache`` is this rank's cache tensor (shape, dtype, contiguity)."""
        blocks = 2 if self.kind == "kv" else 1
        dims = len(self.cache_shape(1))
        want = self.cache_shape(cache.shape[blocks]) if cache.dim() == dims else None
        if tuple(cache.shape) != want or cache.dtype != self.torch_dtype:
            names = (
                "[layers, 2, blocks, block_size, local kv heads, head_dim]"
                if self.kind == "kv"
                else "[layers, blocks, block_size, local latent heads * head_dim + rope_dim]"
            )
            raise KVLayoutError(
                f"the cache is {tuple(cache.shape)} {cache.dtype}; this rank's layout "
                f"({self.describe()}) needs {names} = {want or f'{dims} dims'} of {self.dtype}"
            )
        if not cache.is_contiguous():
            raise KVLayoutError(
                "the cache must be contiguous (the engine allocates it in one piece)"
            )

    def check_compatible(self, other: KVLayout) -> None:
        """Raise unless KV computed under ``self`` can be written into a cache laid out as
        ``other`` (the other pool; tensor-parallel degrees may differ)."""
        for name in (
            "kind",
            "num_layers",
            "block_size",
            "num_kv_heads",
            "head_dim",
            "rope_dim",
            "replicated",
            "dtype",
        ):
            a, b = getattr(self, name), getattr(other, name)
            if a != b:
                what = "both pools must serve the same model with the same KV dtype"
                if name == "block_size":
                    what = "the pools must use the same block size (set decode.block_size to match)"
                raise KVLayoutError(
                    f"KV layouts differ in {name}: this pool has {name}={a!r}, "
                    f"the other has {name}={b!r}; {what}"
                )

    def describe(self) -> str:
        where = f"rank {self.tp_rank}/{self.tp_size} holding heads {list(self.head_range)}"
        if self.kind == "kv":
            return (
                f"{self.num_layers} layers, block_size {self.block_size}, {self.num_kv_heads}"
                f" kv heads x {self.head_dim} ({self.dtype}), {where}"
            )
        share = "replicated" if self.replicated else "sharded"
        return (
            f"{self.num_layers} layers, block_size {self.block_size}, {self.num_kv_heads} "
            f"latent heads x {self.head_dim} + rope {self.rope_dim} ({self.dtype}, {share}),"
            f" {where}"
        )

    def to_proto(self, msg=None):
        """The layout as ``kv_transfer.proto``'s ``KVLayout`` (its only serialized form)."""
        from pdserve.kv_transfer import kv_transfer_pb2 as pb

        msg = pb.KVLayout() if msg is None else msg
        for name in self.__dataclass_fields__:
            setattr(msg, name, getattr(self, name))
        return msg

    @classmethod
    def from_proto(cls, msg) -> KVLayout:
        fields = {name: getattr(msg, name) for name in cls.__dataclass_fields__}
        return cls(**{**fields, "kind": msg.kind or "kv"})


def cache_layout(engine) -> KVLayout:
    """The layout of one rank's cache, from its engine (``engine.LLMEngine`` or a rank's
    ``RankEngine``: the model shard's config, dtype and tensor-parallel place, and its
    ``kv_view()``'s block size). A model with ``cfg.mla``
    (``engine/mla_config.py``) caches a latent row per token: MLA's one latent replicated
    on every rank, GLA's latent heads and GTA's tied states sharded across them."""
    m, cfg, size = engine.model, engine.model.cfg, engine.kv_view().block_size
    dtype, mla = dtype_name(m.dtype), cfg.mla
    if mla is not None:
        return KVLayout(
            cfg.num_layers,
            size,
            mla.latent_heads,
            mla.kv_lora_rank,
            dtype,
            m.tp.size,
            m.tp.rank,
            "latent",
            mla.qk_rope_head_dim,
            replicated=mla.replicated,
        )
    return KVLayout(
        cfg.num_layers, size, cfg.num_kv_heads, cfg.head_dim, dtype, m.tp.size, m.tp.rank
    )
