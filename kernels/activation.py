"""SiLU-and-multiply, the gated MLP activation: out = silu(x[..., :I]) * x[..., I:].

``_silu_and_mul_kernel``, grid (rows, cdiv(I, BLOCK)): one program computes BLOCK
outputs of one row in float32 and rounds once to the input dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_o, INTER: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTER
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + INTER + offs, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] -> [..., I] = silu(x[..., :I]) * x[..., I:]."""
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"x: expected [..., 2I] with an even last dimension, got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"x: expected a floating point dtype, got {x.dtype}")
    inter = x.shape[-1] // 2
    rows = x.reshape(-1, 2 * inter)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype, device=x.device)
    n = rows.shape[0]
    if n and inter:
        block = min(BLOCK, triton.next_power_of_2(inter))
        _silu_and_mul_kernel[(n, triton.cdiv(inter, block))](
            rows, out, rows.stride(0), inter, INTER=inter, BLOCK=block
        )
    return out


def ref_silu_and_mul(x):
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)
