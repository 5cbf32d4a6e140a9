"""Paged attention in plain torch: the backend used on CPU and the engine's reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.backend import AttentionBackend, AttentionMetadata
from engine.attention.cpu_kernel import DecodeKernel, decode_kernel
from engine.attention.cpu_prefill import PrefillKernel, prefill_kernel


def write_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Scatter new K/V rows [T, Hkv, D] into [num_blocks, block_size, Hkv, D] caches."""
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v)


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """Blocks [B, nb] of a cache, as a strided [B, Hkv, nb * block_size, D] view of one copy."""
    b, nb = block_tables.shape
    blocks = cache.index_select(0, block_tables.flatten())  # [B * nb, block_size, Hkv, D]
    return blocks.view(b, nb * cache.shape[1], *cache.shape[2:]).transpose(1, 2)


class TorchAttentionBackend(AttentionBackend):
    """Prefill chunks run one sequence at a time, decodes as one batch. In float32 on
    CPU both go through C kernels that read the blocks in place (``cpu_prefill.py``,
    ``cpu_kernel.py``); elsewhere, or with ``use_kernel=False`` or no compiler, through
    ``scaled_dot_product_attention`` on K/V gathered from the blocks (a chunk with no
    earlier context on its own K/V)."""

    name = "torch"

    def __init__(self, use_kernel: bool = True):
        self.use_kernel = use_kernel

    def forward(
        self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, window=None,
        softcap=None,
    ):  # fmt: skip
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.num_prefills == 0:
            return self._decode(q, k_cache, v_cache, meta, scale)
        out = torch.empty_like(q)
        block_size = k_cache.shape[1]
        kernel = self._prefill_kernel(q, k_cache, v_cache)
        start = 0
        for i in range(meta.num_prefills):
            n, ctx = meta.query_lens_host[i], meta.seq_lens_host[i]
            if kernel is not None:
                rows = slice(start, start + n)
                kernel(q[rows], k_cache, v_cache, meta.block_tables[i], ctx, scale, out[rows])
                start += n
                continue
            qi = q[start : start + n].transpose(0, 1).unsqueeze(0)
            if ctx == n:  # no earlier context: the chunk's own K/V are the whole history
                ki = k[start : start + n].transpose(0, 1).unsqueeze(0)
                vi = v[start : start + n].transpose(0, 1).unsqueeze(0)
                mask, causal = None, True
            else:
                table = meta.block_tables[i : i + 1, : -(-ctx // block_size)]
                ki = gather_kv(k_cache, table)[:, :, :ctx]
                vi = gather_kv(v_cache, table)[:, :, :ctx]
                rows = torch.arange(ctx - n, ctx, device=q.device).unsqueeze(1)
                mask, causal = torch.arange(ctx, device=q.device).unsqueeze(0) <= rows, False
            oi = F.scaled_dot_product_attention(
                qi, ki, vi, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
            )
            out[start : start + n] = oi[0].transpose(0, 1)
            start += n
        if meta.num_decodes:
            out[start:] = self._decode(q[start:], k_cache, v_cache, meta, scale)
        return out

    def _prefill_kernel(self, q, k_cache, v_cache) -> PrefillKernel | None:
        if self.use_kernel and PrefillKernel.supports(q, k_cache, v_cache):
            return prefill_kernel()
        return None

    def _decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        """One query token per sequence; padding past each length is masked out."""
        first = meta.num_prefills
        if self.use_kernel and DecodeKernel.supports(q, k_cache, v_cache):
            kernel = decode_kernel()
            if kernel is not None:
                tables, lens = meta.block_tables[first:], meta.seq_lens[first:]
                return kernel(q, k_cache, v_cache, tables, lens, scale)
        if "decode" not in meta.derived:
            max_len = max(meta.seq_lens_host[first:])
            tables = meta.block_tables[first:, : -(-max_len // k_cache.shape[1])]
            width = tables.shape[1] * k_cache.shape[1]
            lens = meta.seq_lens[first:].view(-1, 1, 1, 1)
            mask = torch.arange(width, device=q.device).view(1, 1, 1, -1) < lens
            meta.derived["decode"] = tables, mask
        tables, mask = meta.derived["decode"]
        keys, values = gather_kv(k_cache, tables), gather_kv(v_cache, tables)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys, values, attn_mask=mask, scale=scale, enable_gqa=True
        )
        return out.squeeze(2)
