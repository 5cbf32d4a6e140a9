"""Paged prefill attention for chunked prefill (varlen, causal, online softmax).

Sequence i owns query rows query_start_loc[i]:query_start_loc[i+1] (its chunk of
q_len new tokens); its cache already holds all seq_lens[i] tokens, the chunk's K/V
included (written by ``write_kv_cache`` first). Chunk token j sits at position
ctx = seq_lens[i] - q_len plus j and attends to cache positions 0..ctx + j.

``_prefill_kernel``, grid (num_seqs, num_kv_heads, query tiles): a tile packs
TOKENS_PER_TILE chunk tokens times the GROUP query heads of one KV head into
BLOCK_M rows (row r = token r // GROUP, head r % GROUP), so K/V are loaded once per
GQA group. Keys are gathered BLOCK_N at a time through the block table with a
FlashAttention online softmax: never more than a [BLOCK_M, BLOCK_N] score tile.
Keys every row of the tile may see run without a mask; the causal diagonal after.
Programs past the end of a short chunk exit at once.

With a sliding window W the token at position p sees max(0, p - W + 1) .. p only: a
tile's key loop starts at the first key its first row sees, so no block table entry
of a block wholly before that key is loaded, and masks the keys before each row's
window as it masks the causal diagonal. Every row sees at least one key of the first
tile (its window starts at most TOKENS_PER_TILE - 1 <= BLOCK_N - 1 keys after the
tile's first key), so the online softmax never meets a row with no key yet. With a
softcap c each score s = scale * q . k becomes c * tanh(s / c) before the mask.

The mixed step (prefill chunks first, then decodes): the Triton backend serves it
with a pair of launches over the two halves of the same batch, this kernel for the
prefill sequences and ``paged_decode_attention`` for the decodes. This kernel alone
also serves it in one launch (a decode is a chunk of q_len 1), at the price of
tiles that are mostly padding for the decode rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels._checks import check_index, check_paged_attention, check_window
from pdserve.kernels.kv_cache_write import ref_gather_kv
from pdserve.kernels.softcap import softcap_scores

BLOCK_M = 64
BLOCK_N = 64
LOG2E = 1.4426950408889634


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    out_ptr,
    scale_log2,
    window,
    softcap,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    TOKENS_PER_TILE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    tok0 = tl.program_id(2) * TOKENS_PER_TILE
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if tok0 >= q_len:
        return
    ctx = tl.load(seq_lens_ptr + seq) - q_len

    rows = tl.arange(0, BLOCK_M)
    tok = tok0 + rows // GROUP
    heads = kvh * GROUP + rows % GROUP
    row_mask = (rows < TOKENS_PER_TILE * GROUP) & (tok < q_len)
    pos = ctx + tok
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=row_mask[:, None] & d_mask[None, :],
        other=0.0,
    )

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kv_end = ctx + tl.minimum(tok0 + TOKENS_PER_TILE, q_len)
    # keys from kv_begin on: those at or before the first row's position (ctx + tok0)
    # and, with a window, at or after the last row's first one (kv_end - window) are
    # seen by every row of the tile; tiles reaching outside need the mask
    kv_begin = 0
    shared_from = 0
    if WINDOWED:
        kv_begin = tl.maximum(ctx + tok0 - window + 1, 0)
        shared_from = kv_end - window
    for n0 in range(kv_begin, kv_end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        masked = (n0 + BLOCK_N > ctx + tok0 + 1) | (n0 < shared_from)
        n_mask = n < kv_end
        blk = tl.load(bt_row + n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        tok_in_blk = n % PAGE_SIZE
        k_off = blk * stride_kb + kvh * stride_kh + tok_in_blk * stride_kt
        # K is loaded transposed, [D, N], ready for the dot.
        k = tl.load(
            k_cache_ptr + k_off[None, :] + offs_d[:, None],
            mask=n_mask[None, :] & d_mask[:, None],
            other=0.0,
        )
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
        if SOFTCAP:
            s = softcap_scores(s, softcap)
        if masked:
            seen = n[None, :] <= pos[:, None]
            if WINDOWED:
                seen &= n[None, :] > pos[:, None] - window
            s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_off = blk * stride_vb + kvh * stride_vh + tok_in_blk * stride_vt
        v = tl.load(
            v_cache_ptr + v_off[:, None] + offs_d[None, :],
            mask=n_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    acc = acc / l_i[:, None]
    o_ptrs = out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


def _check(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, out):
    check_paged_attention(q, k_cache, v_cache, seq_lens, block_tables, out)
    check_index("query_start_loc", query_start_loc, (seq_lens.shape[0] + 1,), torch.int32, q.device)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
    out: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of the chunks in q [T, Hq, D] over their paged caches.

    ``max_query_len`` (host int) avoids a device sync; ``out`` [T, Hq, D] may be a
    strided view. ``window`` (None: all) limits each token at position p to the keys
    max(0, p - window + 1) .. p; ``softcap`` (None: none) caps the scores.
    """
    out = torch.empty_like(q) if out is None else out
    _check(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, out)
    check_window(window, softcap)
    _, hq, d = q.shape
    b = seq_lens.shape[0]
    if b == 0 or q.shape[0] == 0:
        return out
    hkv = k_cache.shape[2]
    group = hq // hkv
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    block_m = max(BLOCK_M, triton.next_power_of_2(group))
    tokens_per_tile = block_m // group
    _prefill_kernel[(b, hkv, triton.cdiv(max_query_len, tokens_per_tile))](
        q,
        k_cache,
        v_cache,
        query_start_loc,
        seq_lens,
        block_tables,
        out,
        scale * LOG2E,
        window or 0,
        (softcap or 0.0) * LOG2E,
        q.stride(0),
        q.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        TOKENS_PER_TILE=tokens_per_tile,
        HEAD_DIM=d,
        BLOCK_D=triton.next_power_of_2(d),
        PAGE_SIZE=k_cache.shape[1],
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        WINDOWED=window is not None,
        SOFTCAP=softcap is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_stages=2 if q.dtype == torch.float32 else 3,
    )
    return out


def ref_paged_prefill_attention(
    q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, window=None, softcap=None
) -> torch.Tensor:
    """The definition: chunk token j of sequence i, at position p = seq_lens[i] - q_len + j,
    attends to its cached positions max(0, p - window + 1) .. p (0 .. p without a window),
    scores scale * q . k soft-capped to softcap * tanh(s / softcap) when given."""
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[2]
    starts = query_start_loc.tolist()
    for i, n in enumerate(seq_lens.tolist()):
        a, e = starts[i], starts[i + 1]
        k, v = ref_gather_kv(k_cache, v_cache, block_tables[i], n)
        first = n - (e - a)  # the chunk's first position: no key before its window is read
        lo = 0 if window is None else max(0, first - window + 1)
        k = k[:, lo:].float().repeat_interleave(group, 0)
        v = v[:, lo:].float().repeat_interleave(group, 0)
        pos = torch.arange(first, n, device=q.device)[:, None]
        keys = torch.arange(lo, n, device=q.device)[None, :]
        visible = keys <= pos
        if window is not None:
            visible &= keys > pos - window
        s = torch.einsum("thd,hnd->htn", q[a:e].float(), k) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        p = torch.softmax(s.masked_fill(~visible, float("-inf")), -1)
        out[a:e] = torch.einsum("htn,hnd->thd", p, v).to(q.dtype)
    return out
