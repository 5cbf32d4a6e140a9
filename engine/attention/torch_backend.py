"""Paged attention in plain torch: the backend used on CPU and the engine's reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.engine.attention.backend import AttentionBackend, AttentionMetadata, check_window
from pdserve.engine.attention.cpu_kernel import DecodeKernel, decode_kernel
from pdserve.engine.attention.cpu_prefill import PrefillKernel, prefill_kernel


def write_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Scatter new K/V rows [T, Hkv, D] into [num_blocks, block_size, Hkv, D] caches."""
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slot_mapping, v)


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """Blocks [B, nb] of a cache, as a strided [B, Hkv, nb * block_size, D] view of one copy."""
    b, nb = block_tables.shape
    blocks = cache.index_select(0, block_tables.flatten())  # [B * nb, block_size, Hkv, D]
    return blocks.view(b, nb * cache.shape[1], *cache.shape[2:]).transpose(1, 2)


def visible(rows: torch.Tensor, keys: torch.Tensor, window: int | None) -> torch.Tensor:
    """Which keys each row sees: key position k for the row at position p when
    k <= p and, with a window W, k >= p - W + 1. rows [..., T, 1], keys [..., 1, L]."""
    mask = keys <= rows
    return mask if window is None else mask & (keys > rows - window)


def attend(q, k, v, mask, scale: float, softcap: float | None) -> torch.Tensor:
    """q [B, Hq, T, D] over k, v [B, Hkv, L, D] where mask [.., T, L] (True: attends;
    None: causal on the last T keys) allows, with soft-capped scores if ``softcap``."""
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
        )
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = q @ k.transpose(-1, -2) * scale
    scores = softcap * torch.tanh(scores / softcap)
    if mask is None:
        t, n = scores.shape[-2:]
        mask = torch.ones(t, n, dtype=torch.bool, device=q.device).tril(n - t)
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ v


class TorchAttentionBackend(AttentionBackend):
    """Prefill chunks run one sequence at a time, decodes as one batch. In float32 on
    CPU both go through C kernels that read the blocks in place (``cpu_prefill.py``,
    ``cpu_kernel.py``); elsewhere, or with ``use_kernel=False`` or no compiler, through
    ``attend`` on K/V gathered from the blocks from the first one inside the window
    (a chunk with no earlier context on its own K/V)."""

    name = "torch"

    def __init__(self, use_kernel: bool = True):
        self.use_kernel = use_kernel

    def forward(
        self,
        q,
        k,
        v,
        k_cache,
        v_cache,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ):
        check_window(window, softcap)
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.num_prefills == 0:
            return self._decode(q, k_cache, v_cache, meta, scale, window, softcap)
        out = torch.empty_like(q)
        block_size = k_cache.shape[1]
        kernel = self._prefill_kernel(q, k_cache, v_cache)
        start = 0
        for i in range(meta.num_prefills):
            n, ctx = meta.query_lens_host[i], meta.seq_lens_host[i]
            rows = slice(start, start + n)
            start += n
            if kernel is not None:
                table = meta.block_tables[i]
                kernel(q[rows], k_cache, v_cache, table, ctx, scale, out[rows], window, softcap)
                continue
            qi = q[rows].transpose(0, 1).unsqueeze(0)
            positions = torch.arange(ctx - n, ctx, device=q.device).unsqueeze(1)
            if ctx == n:  # no earlier context: the chunk's own K/V are the whole history
                ki = k[rows].transpose(0, 1).unsqueeze(0)
                vi = v[rows].transpose(0, 1).unsqueeze(0)
                first = 0
            else:  # from the first block the chunk's first token sees
                first = 0 if window is None else max(0, ctx - n - window + 1) // block_size
                table = meta.block_tables[i : i + 1, first : -(-ctx // block_size)]
                first *= block_size
                ki = gather_kv(k_cache, table)[:, :, : ctx - first]
                vi = gather_kv(v_cache, table)[:, :, : ctx - first]
            mask = None
            if window is not None or ctx != n:
                keys = torch.arange(first, ctx, device=q.device).unsqueeze(0)
                mask = visible(positions, keys, window)
            out[rows] = attend(qi, ki, vi, mask, scale, softcap)[0].transpose(0, 1)
        if meta.num_decodes:
            out[start:] = self._decode(q[start:], k_cache, v_cache, meta, scale, window, softcap)
        return out

    def _prefill_kernel(self, q, k_cache, v_cache) -> PrefillKernel | None:
        if self.use_kernel and PrefillKernel.supports(q, k_cache, v_cache):
            return prefill_kernel()
        return None

    def _decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale, window, softcap):
        """One query token per sequence; keys outside each one's window are masked out."""
        first = meta.num_prefills
        if self.use_kernel and DecodeKernel.supports(q, k_cache, v_cache):
            kernel = decode_kernel()
            if kernel is not None:
                tables, lens = meta.block_tables[first:], meta.seq_lens[first:]
                return kernel(q, k_cache, v_cache, tables, lens, scale, window, softcap)
        if ("decode", window) not in meta.derived:
            meta.derived["decode", window] = _decode_view(meta, k_cache.shape[1], window)
        tables, mask = meta.derived["decode", window]
        keys, values = gather_kv(k_cache, tables), gather_kv(v_cache, tables)
        return attend(q.unsqueeze(2), keys, values, mask, scale, softcap).squeeze(2)


def _decode_view(meta: AttentionMetadata, block_size: int, window: int | None):
    """The decodes' block tables from each one's first block inside its window, [B, nb]
    (entries past a sequence's last block repeat it), and the mask [B, 1, 1, nb *
    block_size] of the keys each decode sees in the gathered blocks."""
    first = meta.num_prefills
    lens = meta.seq_lens[first:].long()
    tables = meta.block_tables[first:]
    if window is None:
        start = torch.zeros_like(lens)
        span = max(meta.seq_lens_host[first:])
    else:
        start = (lens - window).clamp(min=0) // block_size
        span = min(max(meta.seq_lens_host[first:]), window + block_size - 1)
    nb = -(-span // block_size)
    last = (lens - 1) // block_size
    index = (start.unsqueeze(1) + torch.arange(nb, device=lens.device)).minimum(last[:, None])
    tables = tables.gather(1, index)
    keys = start[:, None] * block_size + torch.arange(nb * block_size, device=lens.device)
    mask = visible((lens - 1)[:, None], keys, window)
    return tables, mask.view(len(lens), 1, 1, -1)
