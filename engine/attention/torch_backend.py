"""Paged attention in plain torch: the backend used on CPU and the engine's reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.backend import AttentionBackend, AttentionMetadata


def write_kv(k, v, k_cache, v_cache, slot_mapping, block_size: int) -> None:
    """Scatter new K/V rows [T, Hkv, D] into [num_blocks, Hkv, block_size, D] caches."""
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    k_cache[blocks, :, offsets] = k
    v_cache[blocks, :, offsets] = v


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` cached tokens of one sequence as [Hkv, length, D]."""
    block_size = cache.shape[2]
    blocks = cache[block_table[: -(-length // block_size)]]
    return blocks.transpose(0, 1).flatten(1, 2)[:, :length]


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        block_size = k_cache.shape[2]
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping, block_size)
        out = torch.empty_like(q)
        start = 0
        for i in range(meta.num_prefills):
            n, ctx = meta.query_lens_host[i], meta.seq_lens_host[i]
            qi = q[start : start + n].transpose(0, 1)
            if ctx == n:
                ki, vi = k[start : start + n].transpose(0, 1), v[start : start + n].transpose(0, 1)
                oi = F.scaled_dot_product_attention(
                    qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True
                )
            else:
                ki = gather_kv(k_cache, meta.block_tables[i], ctx)
                vi = gather_kv(v_cache, meta.block_tables[i], ctx)
                rows = torch.arange(ctx - n, ctx, device=q.device).unsqueeze(1)
                mask = torch.arange(ctx, device=q.device).unsqueeze(0) <= rows
                oi = F.scaled_dot_product_attention(
                    qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=True
                )
            out[start : start + n] = oi.transpose(0, 1)
            start += n
        if meta.num_decodes:
            out[start:] = self._decode(q[start:], k_cache, v_cache, meta, scale)
        return out

    def _decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        """One query token per sequence, batched over sequences with a length mask."""
        b, hq, d = q.shape
        hkv, block_size = k_cache.shape[1], k_cache.shape[2]
        first = meta.num_prefills
        lens = meta.seq_lens[first:]
        max_len = max(meta.seq_lens_host[first:])
        tables = meta.block_tables[first:, : -(-max_len // block_size)]
        keys = k_cache[tables].transpose(1, 2).flatten(2, 3)  # [B, Hkv, L, D]
        values = v_cache[tables].transpose(1, 2).flatten(2, 3)
        qg = q.view(b, hkv, hq // hkv, d)
        scores = torch.matmul(qg, keys.transpose(-1, -2)) * scale  # [B, Hkv, G, L]
        pad = torch.arange(keys.shape[2], device=q.device).view(1, 1, 1, -1) >= lens.view(
            -1, 1, 1, 1
        )
        scores.masked_fill_(pad, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        return torch.matmul(probs, values).view(b, hq, d)
