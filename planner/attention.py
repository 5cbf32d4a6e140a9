"""The attention of a model shape as the cost model sees it: what one tensor-parallel rank
caches per token, what a decode step reads and computes, and what a handoff moves.

Two kinds, one interface (``AttentionShape``):

- ``GroupedAttention`` (MHA, GQA): ``num_kv_heads`` distinct K and V heads of
  ``head_dim``; rank r of t holds ``num_kv_heads / t`` of them (the engine's
  ``[layers, 2, blocks, block_size, kv_heads / t, head_dim]`` cache).
- ``LatentAttention`` (MLA, GLA, GTA; Zadouri, Strauss, Dao, arXiv 2505.21487): a cache
  row per token of ``heads`` latent (or tied) heads of width ``dim`` (Hc x Dc) and one
  decoupled RoPE key of width ``rope_dim`` (Dr) shared by every query head (issue 22's
  ``latent_cache [layers, blocks, block_size, Hc_local * Dc + Dr]``). Query head h
  reads latent head h // (H / Hc). Under tensor parallelism t the latent heads are
  sharded, ``Hc / t`` per rank (GLA, GTA: t must divide Hc, as the engine shards
  them), except MLA's single latent, replicated whole on every rank (the paper's
  duplication D = t). Every rank holds its own Dr.

Counts are per layer and per token; ``ModelShape`` multiplies by layers and dtype bytes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


class AttentionShape(ABC):
    """Per layer, per token: cache elements per rank, FLOPs per (query, key) pair, weights."""

    @abstractmethod
    def supports(self, tp: int) -> bool:
        """Whether ``tp`` ranks can split this attention's KV (and query heads) evenly."""

    @abstractmethod
    def row_elements(self, tp: int) -> float:
        """Cache elements one rank of ``tp`` holds per token (K and V, or the latent row)."""

    @abstractmethod
    def decode_flops_per_pair(self, num_heads: int) -> int:
        """Attention FLOPs of one decode query token against one cached token, all
        ``num_heads`` query heads (scores and the weighted sum, 2 FLOPs a MAC)."""

    @abstractmethod
    def prefill_flops_per_pair(self, num_heads: int) -> int:
        """The same for a prompt token (the expanded form for latent attention)."""

    @abstractmethod
    def params(self, hidden: int, num_heads: int) -> int:
        """Weights of the attention projections (Q, K/V or latent, output)."""

    @property
    def replicated(self) -> bool:
        """Whether every rank holds the whole row (MLA's single latent)."""
        return False

    def transfer_elements(self, decode_tp: int) -> float:
        """Cache elements per token a decode instance of ``decode_tp`` ranks receives in a
        handoff over the wire: every rank its own row (whatever the prefill degree), so
        sharded heads travel once in all, plus one RoPE key per rank; a replicated row
        (MLA's latent) once per decode instance, to rank 0, which forwards it to its
        other ranks over its tensor-parallel group (not counted here). The one place this
        rule lives (issue 22's KV transport sends this)."""
        copies = 1 if self.replicated else decode_tp
        return copies * self.row_elements(decode_tp)

    def arithmetic_intensity(self, tp: int, num_heads: int, dtype_bytes: int) -> float:
        """Decode attention FLOPs per cache byte one rank reads (long contexts, one query
        token): ~1 for MHA, ~g_q for GQA, ~2 g_q for GTA and GLA, ~2 h_q for MLA
        (the paper's Table 1; here the RoPE key's bytes and FLOPs are counted)."""
        return self.decode_flops_per_pair(num_heads) / tp / (self.row_elements(tp) * dtype_bytes)


@dataclass(frozen=True)
class GroupedAttention(AttentionShape):
    """MHA (``num_kv_heads`` = query heads), GQA, MQA: distinct K and V heads."""

    num_kv_heads: int
    head_dim: int

    def supports(self, tp: int) -> bool:
        return self.num_kv_heads % tp == 0

    def row_elements(self, tp: int) -> float:
        """An even share of the heads (whole where ``supports(tp)``)."""
        return 2 * self.num_kv_heads * self.head_dim / tp

    def decode_flops_per_pair(self, num_heads: int) -> int:
        return 2 * 2 * num_heads * self.head_dim

    def prefill_flops_per_pair(self, num_heads: int) -> int:
        return self.decode_flops_per_pair(num_heads)

    def params(self, hidden: int, num_heads: int) -> int:
        return hidden * self.head_dim * (2 * num_heads + 2 * self.num_kv_heads)


@dataclass(frozen=True)
class LatentAttention(AttentionShape):
    """MLA (``heads`` 1), GLA (``heads`` h_c latent heads) or GTA (``heads`` tied groups).

    Cache: ``heads`` x ``dim`` (Hc x Dc) + ``rope_dim`` (Dr). Absorbed decode: scores read
    the first ``key_dim`` (Dk) of the query head's latent head plus the RoPE key, the
    output is a weighted sum of the whole latent head (Dc); Dk = Dc for MLA and GLA, Dc/2
    for GTA (the key's un-rotated half is the tied state's first half).

    Projections: ``q_lora_rank`` (0: a plain query projection) to ``num_heads`` x
    (``qk_nope_dim`` + Dr); a down projection of the hidden state to the cache row; with
    ``up_projected`` (MLA, GLA) each latent head's up projection to the keys' no-RoPE part
    (``qk_nope_dim``) and the values (``v_head_dim``) of its group's query heads (GTA has
    none: the tied state is the value, its first half the key's); the output projection
    from ``num_heads`` x ``v_head_dim``.
    """

    heads: int
    dim: int
    rope_dim: int
    key_dim: int
    qk_nope_dim: int
    v_head_dim: int
    q_lora_rank: int = 0
    up_projected: bool = True

    def __post_init__(self):
        if not 0 < self.key_dim <= self.dim:
            raise ValueError(f"LatentAttention.key_dim={self.key_dim}: allowed 1..dim ({self.dim})")

    def supports(self, tp: int) -> bool:
        return self.heads == 1 or self.heads % tp == 0

    @property
    def replicated(self) -> bool:
        return self.heads == 1

    def local_heads(self, tp: int) -> int:
        """Latent heads one rank of ``tp`` holds: its share, or MLA's one latent."""
        if not self.supports(tp):
            raise ValueError(
                f"tensor_parallel={tp} with {self.heads} latent heads: allowed degrees divide "
                "the latent heads (a single latent, MLA's, is replicated on any degree)"
            )
        return max(1, self.heads // tp)

    def row_elements(self, tp: int) -> int:
        return self.local_heads(tp) * self.dim + self.rope_dim

    def decode_flops_per_pair(self, num_heads: int) -> int:
        return 2 * num_heads * (self.key_dim + self.rope_dim + self.dim)

    def prefill_flops_per_pair(self, num_heads: int) -> int:
        return 2 * num_heads * (self.qk_nope_dim + self.rope_dim + self.v_head_dim)

    def params(self, hidden: int, num_heads: int) -> int:
        q_width = num_heads * (self.qk_nope_dim + self.rope_dim)
        if self.q_lora_rank:
            q = hidden * self.q_lora_rank + self.q_lora_rank * q_width
        else:
            q = hidden * q_width
        down = hidden * (self.heads * self.dim + self.rope_dim)
        up = self.dim * num_heads * (self.qk_nope_dim + self.v_head_dim)
        out = num_heads * self.v_head_dim * hidden
        return q + down + (up if self.up_projected else 0) + out
