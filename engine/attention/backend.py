"""The attention interface every backend implements, and the batch metadata it reads."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """Describes one forward pass over a varlen batch of sequences.

    The batch flattens the new tokens of B sequences into T rows. Sequences that
    prefill (a chunk of one or more prompt tokens) come first, then the
    ``num_decodes`` sequences that decode exactly one token each.

    Shapes (all on the device of the model):
      query_start_loc  [B + 1] int32  cumulative new-token counts; sequence i owns
                                      rows query_start_loc[i]:query_start_loc[i+1]
      seq_lens         [B]     int32  tokens in the cache for sequence i after this
                                      pass (earlier context + its new tokens)
      block_tables     [B, M]  int32  physical block ids of sequence i in order;
                                      entries past ceil(seq_lens[i] / block_size)
                                      are padding and never read
      slot_mapping     [T]     int64  cache slot (block_id * block_size + offset)
                                      where each new token's K/V is written
    The new token at row r of sequence i sits at position
    seq_lens[i] - (query_start_loc[i+1] - r) and attends causally to cache
    positions 0..that position of its own sequence.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    num_decodes: int
    max_query_len: int
    max_seq_len: int
    # Host copies (plain lists) so CPU code can loop without device syncs.
    query_lens_host: list[int]
    seq_lens_host: list[int]
    # A backend's own values derived from this metadata (masks, sliced tables), computed
    # by the first layer of a forward pass and reused by the others.
    derived: dict = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def num_prefills(self) -> int:
        return self.num_seqs - self.num_decodes

    @property
    def num_prefill_tokens(self) -> int:
        return sum(self.query_lens_host[: self.num_prefills])


class AttentionBackend(ABC):
    """Paged attention over a block cache.

    Contract:
      * KV cache of one layer: ``k_cache`` and ``v_cache``, each
        [num_blocks, block_size, num_kv_heads, head_dim] (token-major blocks, as
        vLLM lays them out: a gathered run of blocks is a strided [L, Hkv, D] view).
      * ``forward(q, k, v, k_cache, v_cache, meta, scale, window=None, softcap=None)``
        with q [T, Hq, D] and k, v [T, Hkv, D] for the T new tokens (rotary already
        applied): writes k, v into the caches at ``meta.slot_mapping``, then returns
        [T, Hq, D], each row attending causally to its sequence's cached tokens as
        ``AttentionMetadata`` describes. Hq is a multiple of Hkv (GQA; Hkv=1 is MQA),
        query head h reads KV head h // (Hq // Hkv).
      * ``window`` (None: full causal attention) is a sliding window of W >= 1 tokens,
        as HF transformers masks it: the token at position p attends to positions
        max(0, p - W + 1) .. p, the last W tokens, itself included. Models pass each
        layer's own window (None for global layers).
      * ``softcap`` (None: no capping) caps each score s = scale * q . k to
        softcap * tanh(s / softcap) before the mask and the softmax (Gemma 2).
      * With a window, the blocks of a sequence wholly before position p0 - W + 1
        (p0: the position of its first new token in the pass) are never read: their
        block table entries are never used, so the block manager may free those
        blocks and leave the entries as placeholders naming any block. (The C and
        Triton kernels read no position before p0 - W + 1 at all; the plain-torch
        path reads the whole block holding it and masks.)
      * Results must not depend on what else is in the batch beyond float rounding,
        and with the same inputs must be deterministic.
    """

    name: str

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor: ...


def check_window(window: int | None, softcap: float | None) -> None:
    """A window is None or an int >= 1; a softcap is None or a float > 0."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)):
        raise ValueError(f"window={window!r}: allowed values are None or an int >= 1")
    if window is not None and window < 1:
        raise ValueError(f"window={window}: allowed values are None or an int >= 1")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap={softcap!r}: allowed values are None or a float > 0")
