"""Rotary position embedding, rotate-half layout (GPT-NeoX / HF Llama).

``_rotary_kernel``, grid (T,): one program rotates all query and key heads of one
token in float32: out[:D/2] = x1*cos - x2*sin, out[D/2:] = x2*cos + x1*sin, with
cos, sin [max_pos, D/2] float32 looked up at the token's position.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels._checks import check_index, check_like


@triton.jit
def _rotate_heads(
    x_ptr,
    o_ptr,
    t,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    c,
    s,
    NUM_HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    h = tl.arange(0, BLOCK_H)[:, None]
    j = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < NUM_HEADS) & (j < HALF)
    x_row = x_ptr + t * stride_xt + h * stride_xh + j
    x1 = tl.load(x_row, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + HALF, mask=mask, other=0.0).to(tl.float32)
    o_row = o_ptr + t * stride_ot + h * stride_oh + j
    dtype = o_ptr.dtype.element_ty
    tl.store(o_row, (x1 * c - x2 * s).to(dtype), mask=mask)
    tl.store(o_row + HALF, (x2 * c + x1 * s).to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_cos,
    stride_sin,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t)
    j = tl.arange(0, BLOCK_HALF)[None, :]
    c = tl.load(cos_ptr + pos * stride_cos + j, mask=j < HALF, other=0.0)
    s = tl.load(sin_ptr + pos * stride_sin + j, mask=j < HALF, other=0.0)
    _rotate_heads(
        q_ptr,
        q_out_ptr,
        t,
        stride_qt,
        stride_qh,
        stride_qot,
        stride_qoh,
        c,
        s,
        NUM_Q_HEADS,
        BLOCK_HQ,
        HALF,
        BLOCK_HALF,
    )
    _rotate_heads(
        k_ptr,
        k_out_ptr,
        t,
        stride_kt,
        stride_kh,
        stride_kot,
        stride_koh,
        c,
        s,
        NUM_K_HEADS,
        BLOCK_HK,
        HALF,
        BLOCK_HALF,
    )


def _check(q, k, positions, cos, sin):
    if q.dim() != 3 or q.shape[2] % 2:
        raise ValueError(f"q: expected [T, num_q_heads, even head_dim], got {tuple(q.shape)}")
    t, _, d = q.shape
    if k.dim() != 3 or k.shape[0] != t or k.shape[2] != d:
        raise ValueError(f"k: expected [{t}, num_kv_heads, {d}], got {tuple(k.shape)}")
    check_like("q", q, k=k)
    check_index("positions", positions, (t,), torch.int64, q.device)
    for name, x in (("cos", cos), ("sin", sin)):
        if x.dim() != 2 or x.shape[1] != d // 2 or x.dtype != torch.float32:
            raise ValueError(
                f"{name}: expected [max_pos, {d // 2}] float32, got {tuple(x.shape)} {x.dtype}"
            )
    check_like("cos", cos, sin=sin)
    if cos.device != q.device:
        raise ValueError(f"cos, sin: expected device {q.device} (q's), got {cos.device}")


def rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated copies of q [T, Hq, D] and k [T, Hkv, D] (both may be strided views)."""
    _check(q, k, positions, cos, sin)
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    t, hq, d = q.shape
    hk = k.shape[1]
    if t:
        _rotary_kernel[(t,)](
            q,
            k,
            q_out,
            k_out,
            positions,
            cos,
            sin,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            q_out.stride(0),
            q_out.stride(1),
            k_out.stride(0),
            k_out.stride(1),
            cos.stride(0),
            sin.stride(0),
            NUM_Q_HEADS=hq,
            NUM_K_HEADS=hk,
            BLOCK_HQ=triton.next_power_of_2(hq),
            BLOCK_HK=triton.next_power_of_2(hk),
            HALF=d // 2,
            BLOCK_HALF=triton.next_power_of_2(d // 2),
        )
    return q_out, k_out


def ref_rotary(q, k, positions, cos, sin):
    c = cos[positions].unsqueeze(1)
    s = sin[positions].unsqueeze(1)

    def rotate(x):
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)
