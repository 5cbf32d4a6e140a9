"""RMSNorm, plain or fused with the residual add.

``_rms_norm_kernel``, grid (rows,): one program normalizes one row of H elements in
float32. With a residual it first forms x + residual, rounds it to the input dtype
(that is the new residual, stored), and normalizes the rounded value, exactly as
the unfused ``residual = x + residual; rms_norm(residual)`` does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    H: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        summed = (x + r).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + offs, summed, mask=mask)
        x = summed.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, 0) / H + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + row * stride_o + offs, (x * inv_rms * w).to(out_ptr.dtype.element_ty), mask=mask
    )


def _rows(name: str, x: torch.Tensor, h: int) -> torch.Tensor:
    if x.dim() == 0 or x.shape[-1] != h:
        raise ValueError(f"{name}: expected [..., {h}], got {tuple(x.shape)}")
    rows = x.reshape(-1, h)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    return rows


def _launch(x, residual, w, eps):
    if w.dim() != 1:
        raise ValueError(f"w: expected [H], got {tuple(w.shape)}")
    h = w.shape[0]
    if w.stride(0) != 1:
        raise ValueError("w: expected a contiguous tensor")
    xr = _rows("x", x, h)
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"residual: expected {tuple(x.shape)} {x.dtype} like x, got "
            f"{tuple(residual.shape)} {residual.dtype}"
        )
    rr = _rows("residual", residual, h) if residual is not None else xr
    for name, t in (("w", w), ("residual", residual)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name}: expected device {x.device} (x's), got {t.device}")
    if not x.is_floating_point() or not w.is_floating_point():
        raise ValueError(f"x, w: expected floating point, got {x.dtype}, {w.dtype}")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out) if residual is not None else out
    n = xr.shape[0]
    if n:
        _rms_norm_kernel[(n,)](
            xr,
            rr,
            w,
            out,
            res_out,
            eps,
            xr.stride(0),
            rr.stride(0),
            h,
            h,
            H=h,
            BLOCK=triton.next_power_of_2(h),
            HAS_RESIDUAL=residual is not None,
            num_warps=4 if h <= 4096 else 8,
        )
    return out, res_out


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H] / rms(x) * w [H], computed in float32, returned in x's dtype."""
    return _launch(x, None, w, eps)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass; inputs are not modified."""
    return _launch(x, residual, w, eps)


def ref_rms_norm(x, w, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def ref_add_rms_norm(x, residual, w, eps):
    residual = x + residual
    return ref_rms_norm(residual, w, eps), residual
