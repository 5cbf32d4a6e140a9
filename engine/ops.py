"""Element-wise and normalization ops of the decoder, swappable per backend.

The attention backend chooses the op set: the torch backend uses ``TorchOps``,
the Triton backend its fused kernels. Both compute the same functions.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F

from pdserve.engine.cpu_ops import CpuOps, cpu_ops


class Ops(ABC):
    """Contract (shapes are for T tokens):

    * ``rms_norm(x [T, H], w [H], eps)`` -> [T, H]: x / rms(x) * w, computed in float32.
    * ``add_rms_norm(x, residual, w, eps)`` -> (normed, new_residual) with
      new_residual = x + residual and normed = rms_norm(new_residual).
    * ``rope(positions [T] int64, cos, sin)`` with cos, sin [max_pos, D/2] float32:
      whatever ``rotary`` needs for these tokens, computed once per forward pass.
    * ``rotary(q [T, Hq, D], k [T, Hkv, D], rope)`` -> (q', k'); rotate-half
      (GPT-NeoX/HF Llama) layout: out[:D/2] = x1*c - x2*s, out[D/2:] = x2*c + x1*s
      with c, s the tables at each token's position.
    * ``silu_and_mul(x [T, 2I])`` -> [T, I] = silu(x[:, :I]) * x[:, I:].
    """

    @abstractmethod
    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor: ...

    @abstractmethod
    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    @abstractmethod
    def rope(self, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple: ...

    @abstractmethod
    def rotary(
        self, q: torch.Tensor, k: torch.Tensor, rope: tuple
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    @abstractmethod
    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor: ...


class TorchOps(Ops):
    """Plain torch, and in float32 on CPU the one-pass C ops of ``engine/cpu_ops.py``
    (unless ``use_kernel=False`` or they cannot be built). ``rotary`` rotates q and k
    in place (the decoder passes views of its fresh QKV projection). ``rms_norm``
    spells out HF's formula: ``F.rms_norm`` takes 2.2 ms for 2048 x 576 floats here,
    these ops 0.25 ms."""

    def __init__(self, use_kernel: bool = True):
        self.use_kernel = use_kernel

    def _native(self, x: torch.Tensor) -> CpuOps | None:
        return cpu_ops() if self.use_kernel and CpuOps.supports(x) else None

    def rms_norm(self, x, w, eps):
        native = self._native(x)
        if native is not None:
            return native.add_rms_norm(x, None, w, eps)[0]
        xf = x.float()
        inv = xf.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
        out = torch.mul(xf, inv).mul_(w.float())
        return out if x.dtype == torch.float32 else out.to(x.dtype)

    def add_rms_norm(self, x, residual, w, eps):
        native = self._native(x)
        if native is not None:
            return native.add_rms_norm(x, residual, w, eps)
        residual = x + residual
        return self.rms_norm(residual, w, eps), residual

    def rope(self, positions, cos, sin):
        # rotate_half(x) * sin == roll(x, D/2) * [-sin, sin]: four ops a tensor, no cat;
        # the C rotary reads the tables at the positions itself
        c, s = cos[positions], sin[positions]
        c, s = torch.cat((c, c), -1).unsqueeze(1), torch.cat((-s, s), -1).unsqueeze(1)
        return c, s, positions.to(torch.int64).contiguous(), cos.contiguous(), sin.contiguous()

    def rotary(self, q, k, rope):
        c, s, positions, cos, sin = rope
        native = self._native(q)
        out = []
        for x in (q, k):
            if native is None or not native.rotary_(x, positions, cos, sin):
                x = _rotate(x, c, s)
            out.append(x)
        return out[0], out[1]

    def silu_and_mul(self, x):
        native = self._native(x)
        if native is not None and x.dim() == 2:
            return native.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)


def _rotate(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.float32:
        xf = x.float()
        return (xf * c + xf.roll(x.shape[-1] // 2, dims=-1) * s).to(x.dtype)
    rolled = x.roll(x.shape[-1] // 2, dims=-1)
    return x.mul_(c).addcmul_(rolled, s)
