"""Paged decode attention (flash-decoding): one query token per sequence.

Pass 1, ``_decode_split_kernel``, grid (num_seqs, num_kv_heads, num_splits): one
program takes one sequence, one KV head and one partition of the context, and
computes the attention of *all* query heads of that KV head together (a
[BLOCK_H, D] query tile, GQA/MQA-aware), so each K/V byte is read from the cache
once. Keys are gathered BLOCK_N at a time through the block table, with an online
softmax. With one split the program writes the final output; otherwise it writes
a normalized partial output and its log-sum-exp (base 2), and pass 2,
``_decode_reduce_kernel``, grid (num_seqs, num_q_heads), merges the splits.
The partition length is a runtime argument: a growing context does not recompile.

With a sliding window W the query (position seq_len - 1) sees the positions
lo = max(0, seq_len - W) .. seq_len - 1, and the splits partition that range only:
no block table entry of a block wholly before lo is loaded, nor any key before lo.
With a softcap c each score s = scale * q . k becomes c * tanh(s / c) first.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pdserve.kernels._checks import check_paged_attention, check_window
from pdserve.kernels.kv_cache_write import ref_gather_kv
from pdserve.kernels.softcap import softcap_scores

# Tiling, read at every launch (bench/tune_decode.py sweeps them on a GPU).
BLOCK_N = 64
MIN_PARTITION = 256
PROGRAMS_PER_SM = 4
NUM_WARPS = 2
NUM_STAGES = 3
LOG2E = 1.4426950408889634


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    scale_log2,
    partition,
    window,
    softcap,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bt,
    stride_ob,
    stride_oh,
    stride_pb,
    stride_ph,
    stride_ps,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = split * partition
    if WINDOWED:
        start += tl.maximum(seq_len - window, 0)
    if start >= seq_len:
        return
    end = tl.minimum(start + partition, seq_len)

    rows = tl.arange(0, BLOCK_H)
    heads = kvh * GROUP + rows
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = rows < GROUP
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=h_mask[:, None] & d_mask[None, :],
        other=0.0,
    )

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < end
        blk = tl.load(bt_row + n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        tok = n % PAGE_SIZE
        k_off = blk * stride_kb + kvh * stride_kh + tok * stride_kt
        # K is loaded transposed, [D, N], ready for the dot.
        k = tl.load(
            k_cache_ptr + k_off[None, :] + offs_d[:, None],
            mask=n_mask[None, :] & d_mask[:, None],
            other=0.0,
        )
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
        if SOFTCAP:
            s = softcap_scores(s, softcap)
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_off = blk * stride_vb + kvh * stride_vh + tok * stride_vt
        v = tl.load(
            v_cache_ptr + v_off[:, None] + offs_d[None, :],
            mask=n_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    acc = acc / l_i[:, None]
    o_mask = h_mask[:, None] & d_mask[None, :]
    if SPLIT:
        base = seq * stride_pb + heads * stride_ph + split * stride_ps
        tl.store(part_out_ptr + base[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=o_mask)
        tl.store(part_lse_ptr + base, m_i + tl.log2(l_i), mask=h_mask)
    else:
        o_ptrs = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    seq_lens_ptr,
    out_ptr,
    partition,
    window,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    WINDOWED: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    span = tl.load(seq_lens_ptr + seq)
    if WINDOWED:
        span = tl.minimum(span, window)
    num_splits = tl.cdiv(span, partition)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    base = seq * stride_pb + head * stride_ph + offs_s * stride_ps
    lse = tl.load(part_lse_ptr + base, mask=s_mask, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))
    o = tl.load(
        part_out_ptr + base[:, None] * HEAD_DIM + offs_d[None, :],
        mask=s_mask[:, None] & (offs_d[None, :] < HEAD_DIM),
        other=0.0,
    )
    res = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    o_ptrs = out_ptr + seq * stride_ob + head * stride_oh + offs_d
    tl.store(o_ptrs, res.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


def _check(q, k_cache, v_cache, seq_lens, block_tables, out):
    check_paged_attention(q, k_cache, v_cache, seq_lens, block_tables, out)
    if seq_lens.shape[0] != q.shape[0]:
        raise ValueError(f"seq_lens: expected [{q.shape[0]}] (one per q row), got {seq_lens.shape}")


def _num_splits(max_seq_len: int, programs: int, device: torch.device) -> int:
    """Enough context splits for about PROGRAMS_PER_SM programs per SM (a nominal 4 SMs
    off CUDA), each split at least MIN_PARTITION tokens long."""
    sms = _multiprocessors(device.index or 0) if device.type == "cuda" else 4
    wanted = triton.cdiv(PROGRAMS_PER_SM * sms, programs)
    return max(1, min(wanted, triton.cdiv(max_seq_len, MIN_PARTITION)))


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of q [B, Hq, D] (token seq_lens[b] - 1 of each sequence) over its cache.

    ``max_seq_len`` (host int) avoids a device sync; ``num_splits`` overrides the
    flash-decoding split heuristic; ``out`` [B, Hq, D] may be a strided view.
    ``window`` (None: all) keeps the last ``window`` cached tokens of each sequence;
    ``softcap`` (None: none) caps the scores.
    """
    out = torch.empty_like(q) if out is None else out
    _check(q, k_cache, v_cache, seq_lens, block_tables, out)
    check_window(window, softcap)
    b, hq, d = q.shape
    if b == 0:
        return out
    hkv = k_cache.shape[2]
    group = hq // hkv
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    if window is not None:  # the longest range a split partitions
        max_seq_len = min(max_seq_len, window)
    if num_splits is None:
        num_splits = _num_splits(max_seq_len, b * hkv, q.device)
    partition = triton.cdiv(triton.cdiv(max_seq_len, num_splits), BLOCK_N) * BLOCK_N
    num_splits = triton.cdiv(max_seq_len, partition)
    block_d = triton.next_power_of_2(d)
    if num_splits > 1:
        part_out = torch.empty(b, hq, num_splits, d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(b, hq, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out
    _decode_split_kernel[(b, hkv, num_splits)](
        q,
        k_cache,
        v_cache,
        seq_lens,
        block_tables,
        out,
        part_out,
        part_lse,
        scale * LOG2E,
        partition,
        window or 0,
        (softcap or 0.0) * LOG2E,
        q.stride(0),
        q.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        hq * num_splits,
        num_splits,
        1,
        GROUP=group,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=d,
        BLOCK_D=block_d,
        PAGE_SIZE=k_cache.shape[1],
        BLOCK_N=BLOCK_N,
        SPLIT=num_splits > 1,
        WINDOWED=window is not None,
        SOFTCAP=softcap is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(b, hq)](
            part_out,
            part_lse,
            seq_lens,
            out,
            partition,
            window or 0,
            hq * num_splits,
            num_splits,
            1,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=d,
            BLOCK_D=block_d,
            BLOCK_S=triton.next_power_of_2(num_splits),
            WINDOWED=window is not None,
        )
    return out


def ref_paged_decode_attention(
    q, k_cache, v_cache, seq_lens, block_tables, scale, window=None, softcap=None
):
    """The definition: sequence i's query at position n - 1 (n = seq_lens[i]) attends to
    its cached positions max(0, n - window) .. n - 1 (all n without a window), scores
    scale * q . k soft-capped to softcap * tanh(s / softcap) when given."""
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[2]
    for i, n in enumerate(seq_lens.tolist()):
        k, v = ref_gather_kv(k_cache, v_cache, block_tables[i], n)
        lo = 0 if window is None else max(0, n - window)
        k = k[:, lo:].float().repeat_interleave(group, 0)
        v = v[:, lo:].float().repeat_interleave(group, 0)
        s = torch.einsum("hd,hnd->hn", q[i].float(), k) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        out[i] = torch.einsum("hn,hnd->hd", torch.softmax(s, -1), v).to(q.dtype)
    return out
