"""Paged decode attention over a latent / tied KV cache (MLA, GLA, GTA): absorbed form.

One query token per sequence. Each cached token holds Hc latent (or tied) heads of
width Dc and one decoupled RoPE key of width Dr shared by every query head; query head
h reads latent head h // (H // Hc). With q_c [B, H, Dk] (Dk <= Dc: the query already
multiplied into latent space) and q_r [B, H, Dr]::

    score[b, h, t] = scale * (q_c[b, h] . c[t, hc, :Dk] + q_r[b, h] . r[t])
    out[b, h]      = sum_t softmax_t(score[b, h]) * c[t, hc, :]        -> [B, H, Dc]

for t < seq_lens[b]. Dk = Dc for MLA and GLA; Dk = Dc / 2 for GTA, whose key is the
first half of the tied state and whose value is all of it.

Caches (one layer of one ``[num_blocks, block_size, Hc * Dc + Dr]`` allocation, read
through strides): ``c_cache`` [num_blocks, block_size, Hc, Dc] and ``r_cache``
[num_blocks, block_size, Dr], each with a contiguous last dimension; token t of
sequence b sits at slot t % block_size of block block_tables[b, t // block_size].

Pass 1, ``_latent_split_kernel``, grid (B, Hc * head_tiles, num_splits): one program
takes one sequence, up to BLOCK_H of the query heads sharing one latent head, and one
partition of the context. It loads each [BLOCK_N, Dc] latent tile once and uses it
both as the keys (its first Dk columns, through a query zero-padded to Dc) and as the
values, with an online softmax in float32. With one split it writes the output;
otherwise a normalized partial output and its log-sum-exp (base 2), which pass 2,
``_latent_reduce_kernel``, grid (B, H), merges. The partition length and split count
are runtime arguments: a growing context does not recompile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels._checks import check_latent_decode
from pdserve.kernels.paged_decode_attention import LOG2E, _num_splits

# Tiling, read at every launch. BLOCK_H query heads share one program's latent tiles.
BLOCK_H = 16
BLOCK_N = 32
NUM_WARPS = 4
NUM_STAGES = 2


@triton.jit
def _latent_split_kernel(
    qc_ptr,
    qr_ptr,
    c_ptr,
    r_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    scale_log2,
    partition,
    num_splits,
    stride_qcb,
    stride_qch,
    stride_qrb,
    stride_qrh,
    stride_cb,
    stride_ct,
    stride_ch,
    stride_rb,
    stride_rt,
    stride_bt,
    stride_ob,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_TILES: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    DK: tl.constexpr,
    DC: tl.constexpr,
    DR: tl.constexpr,
    BLOCK_DC: tl.constexpr,
    BLOCK_DR: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    hc = tl.program_id(1) // HEAD_TILES
    tile = tl.program_id(1) % HEAD_TILES
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = split * partition
    if start >= seq_len:
        return
    end = tl.minimum(start + partition, seq_len)

    in_group = tile * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = in_group < GROUP
    heads = hc * GROUP + in_group
    offs_c = tl.arange(0, BLOCK_DC)
    offs_r = tl.arange(0, BLOCK_DR)
    c_mask = offs_c < DC
    r_mask = offs_r < DR
    # q_c zero-padded from Dk to Dc: a latent tile's value columns add nothing to scores.
    q_c = tl.load(
        qc_ptr + seq * stride_qcb + heads[:, None] * stride_qch + offs_c[None, :],
        mask=h_mask[:, None] & (offs_c[None, :] < DK),
        other=0.0,
    )
    q_r = tl.load(
        qr_ptr + seq * stride_qrb + heads[:, None] * stride_qrh + offs_r[None, :],
        mask=h_mask[:, None] & r_mask[None, :],
        other=0.0,
    )

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DC], tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < end
        blk = tl.load(bt_row + n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        tok = n % PAGE_SIZE
        c_off = blk * stride_cb + tok * stride_ct + hc * stride_ch
        c = tl.load(
            c_ptr + c_off[:, None] + offs_c[None, :],
            mask=n_mask[:, None] & c_mask[None, :],
            other=0.0,
        )
        r_off = blk * stride_rb + tok * stride_rt
        r = tl.load(
            r_ptr + r_off[:, None] + offs_r[None, :],
            mask=n_mask[:, None] & r_mask[None, :],
            other=0.0,
        )
        s = tl.dot(q_c, tl.trans(c), input_precision=DOT_PRECISION)
        s += tl.dot(q_r, tl.trans(r), input_precision=DOT_PRECISION)
        s = tl.where(n_mask[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=DOT_PRECISION)
        m_i = m_new

    acc = acc / l_i[:, None]
    o_mask = h_mask[:, None] & c_mask[None, :]
    if SPLIT:
        # partials: [B, H, num_splits, DC] and [B, H, num_splits], contiguous
        base = (seq * NUM_HEADS + heads) * num_splits + split
        tl.store(part_out_ptr + base[:, None] * DC + offs_c[None, :], acc, mask=o_mask)
        tl.store(part_lse_ptr + base, m_i + tl.log2(l_i), mask=h_mask)
    else:
        o_ptrs = out_ptr + seq * stride_ob + heads[:, None] * stride_oh + offs_c[None, :]
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def _latent_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    seq_lens_ptr,
    out_ptr,
    partition,
    num_splits,
    stride_ob,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    DC: tl.constexpr,
    BLOCK_DC: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    used = tl.cdiv(tl.load(seq_lens_ptr + seq), partition)
    offs_s = tl.arange(0, BLOCK_S)
    offs_c = tl.arange(0, BLOCK_DC)
    s_mask = offs_s < used
    base = (seq * NUM_HEADS + head) * num_splits + offs_s
    lse = tl.load(part_lse_ptr + base, mask=s_mask, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))
    o = tl.load(
        part_out_ptr + base[:, None] * DC + offs_c[None, :],
        mask=s_mask[:, None] & (offs_c[None, :] < DC),
        other=0.0,
    )
    res = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    o_ptrs = out_ptr + seq * stride_ob + head * stride_oh + offs_c
    tl.store(o_ptrs, res.to(out_ptr.dtype.element_ty), mask=offs_c < DC)


def paged_latent_decode(
    q_c: torch.Tensor,
    q_r: torch.Tensor,
    c_cache: torch.Tensor,
    r_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """out [B, H, Dc] in q_c's dtype: the latent decode of the module docstring.

    seq_lens [B] int32 (each >= 1, the new token included); block_tables [B, M] int32.
    ``max_seq_len`` (host int) avoids a device sync; ``num_splits`` overrides the
    context-split heuristic; ``out`` may be a strided view.
    """
    check_latent_decode(q_c, q_r, c_cache, r_cache, block_tables, seq_lens, out)
    b, h, dk = q_c.shape
    _, page_size, hc, dc = c_cache.shape
    dr = r_cache.shape[2]
    if out is None:
        out = torch.empty(b, h, dc, dtype=q_c.dtype, device=q_c.device)
    if b == 0:
        return out
    group = h // hc
    head_tiles = triton.cdiv(group, BLOCK_H)
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    if num_splits is None:
        num_splits = _num_splits(max_seq_len, b * hc * head_tiles, q_c.device)
    partition = triton.cdiv(triton.cdiv(max_seq_len, num_splits), BLOCK_N) * BLOCK_N
    num_splits = triton.cdiv(max_seq_len, partition)
    block_dc = max(16, triton.next_power_of_2(dc))
    if num_splits > 1:
        part_out = torch.empty(b, h, num_splits, dc, dtype=torch.float32, device=q_c.device)
        part_lse = torch.empty(b, h, num_splits, dtype=torch.float32, device=q_c.device)
    else:
        part_out = part_lse = out
    _latent_split_kernel[(b, hc * head_tiles, num_splits)](
        q_c,
        q_r,
        c_cache,
        r_cache,
        block_tables,
        seq_lens,
        out,
        part_out,
        part_lse,
        scale * LOG2E,
        partition,
        num_splits,
        q_c.stride(0),
        q_c.stride(1),
        q_r.stride(0),
        q_r.stride(1),
        *c_cache.stride()[:3],
        *r_cache.stride()[:2],
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        HEAD_TILES=head_tiles,
        NUM_HEADS=h,
        DK=dk,
        DC=dc,
        DR=dr,
        BLOCK_DC=block_dc,
        BLOCK_DR=max(16, triton.next_power_of_2(dr)),
        BLOCK_H=BLOCK_H,
        PAGE_SIZE=page_size,
        BLOCK_N=BLOCK_N,
        SPLIT=num_splits > 1,
        DOT_PRECISION="ieee" if q_c.dtype == torch.float32 else "tf32",
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )
    if num_splits > 1:
        _latent_reduce_kernel[(b, h)](
            part_out,
            part_lse,
            seq_lens,
            out,
            partition,
            num_splits,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=h,
            DC=dc,
            BLOCK_DC=block_dc,
            BLOCK_S=triton.next_power_of_2(num_splits),
        )
    return out


def ref_paged_latent_decode(q_c, q_r, c_cache, r_cache, block_tables, seq_lens, scale):
    """The latent decode of the module docstring in plain torch, one sequence at a time,
    float32 inside, out [B, H, Dc] in q_c's dtype."""
    b, h, dk = q_c.shape
    block_size, hc, dc = c_cache.shape[1:]
    out = torch.empty(b, h, dc, dtype=q_c.dtype, device=q_c.device)
    for i, n in enumerate(seq_lens.tolist()):
        blocks = block_tables[i, : -(-n // block_size)].long()
        c = c_cache[blocks].flatten(0, 1)[:n].float()  # [n, Hc, Dc]
        r = r_cache[blocks].flatten(0, 1)[:n].float()  # [n, Dr]
        c = c.repeat_interleave(h // hc, dim=1)  # [n, H, Dc]: query head h reads h // group
        scores = torch.einsum("hk,nhk->hn", q_c[i].float(), c[..., :dk])
        scores = (scores + torch.einsum("hr,nr->hn", q_r[i].float(), r)) * scale
        out[i] = torch.einsum("hn,nhd->hd", torch.softmax(scores, dim=-1), c).to(q_c.dtype)
    return out
