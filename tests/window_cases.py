"""Sliding-window attention cases shared by the kernel tests: the definition, written as
a dense loop over query rows, and paged caches where nothing before the window is data.

Semantics (HF transformers' ``sliding_window_overlay``): with a window W the token at
position p attends to positions max(0, p - W + 1) .. p; W None is full causal attention.
"""

from __future__ import annotations

import torch

# Windows around the contexts of a case: 1, smaller ones (5 and 21 are no multiple of
# a block), "ctx" (the case's longest context exactly), larger than every context,
# and None (full causal attention).
WINDOWS = [1, 5, 21, 64, "ctx", 1000, None]


def resolve(window, context: int) -> int | None:
    return context if window == "ctx" else window


def first_visible(position: int, window: int | None) -> int:
    return 0 if window is None else max(0, position - window + 1)


def dense_attention(q, keys, values, positions, scale, window=None, softcap=None):
    """q [T, Hq, D] at host positions over one sequence's keys, values [L, Hkv, D], in
    float64, one row at a time on exactly the keys the row sees (no mask). [T, Hq, D].
    Runs on one thread: its many small ops only lose time to thread hand-offs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _dense(q, keys, values, positions, scale, window, softcap)
    finally:
        torch.set_num_threads(threads)


def _dense(q, keys, values, positions, scale, window, softcap):
    hkv = keys.shape[1]
    keys = keys.cpu().double().permute(1, 2, 0)  # [Hkv, D, L]
    values = values.cpu().double().transpose(0, 1)  # [Hkv, L, D]
    q = q.cpu().double().unflatten(1, (hkv, -1))  # [T, Hkv, G, D]: head h * G + g
    out = torch.empty(q.shape, dtype=torch.float64)
    for t, p in enumerate(positions):
        lo = first_visible(p, window)
        s = q[t] @ keys[:, :, lo : p + 1] * scale  # [Hkv, G, keys seen]
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        out[t] = torch.softmax(s, -1) @ values[:, lo : p + 1]
    return out.flatten(1, 2)


def paged_sequences(specs, block_size, num_kv_heads, head_dim, dtype=torch.float32, seed=0):
    """Caches holding sequences given as (length, first read position) in shuffled blocks.

    Positions before a sequence's first read hold NaN, and the table entries of its
    blocks wholly before it name block 0, a NaN placeholder (as after the block manager
    freed them), as do the padding entries; unused slots hold NaN too. A kernel that
    reads anything before the window fails its test. Returns k_cache, v_cache, block
    tables [B, max blocks + 1] int32, and each sequence's keys and values [L, Hkv, D].
    """
    g = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block_size) for n, _ in specs]
    num_blocks = sum(per_seq) + 1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    free = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    tables = torch.zeros(len(specs), max(per_seq) + 1, dtype=torch.int32)
    keys, values = [], []
    for i, (n, first) in enumerate(specs):
        k = torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=g).to(dtype)
        k[:first], v[:first] = float("nan"), float("nan")
        keys.append(k)
        values.append(v)
        for b in range(per_seq[i]):
            if (b + 1) * block_size <= first:
                continue  # wholly before the window: the placeholder stays
            tables[i, b] = free.pop()
            rows = slice(b * block_size, min(n, (b + 1) * block_size))
            k_cache[tables[i, b], : rows.stop - rows.start] = k[rows]
            v_cache[tables[i, b], : rows.stop - rows.start] = v[rows]
    return k_cache, v_cache, tables, keys, values
