"""Element-wise and normalization ops of the decoder, swappable per backend.

The attention backend chooses the op set: the torch backend uses ``TorchOps``,
the Triton backend its fused kernels. Both compute the same functions.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F


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
    def rms_norm(self, x, w, eps):
        if x.dtype == torch.float32:
            return F.rms_norm(x, w.shape, w, eps)
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)

    def add_rms_norm(self, x, residual, w, eps):
        residual = x + residual
        return self.rms_norm(residual, w, eps), residual

    def rope(self, positions, cos, sin):
        # rotate_half(x) * sin == roll(x, D/2) * [-sin, sin]: four ops a tensor, no cat
        c, s = cos[positions], sin[positions]
        return torch.cat((c, c), -1).unsqueeze(1), torch.cat((-s, s), -1).unsqueeze(1)

    def rotary(self, q, k, rope):
        c, s = rope
        return _rotate(q, c, s), _rotate(k, c, s)

    def silu_and_mul(self, x):
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


def _rotate(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    out = xf * c + xf.roll(x.shape[-1] // 2, dims=-1) * s
    return out if x.dtype == torch.float32 else out.to(x.dtype)
